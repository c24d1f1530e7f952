"""Hypothesis strategies for the transformers cache (tests/test_hf.py)."""
from hypothesis import strategies as st


@st.composite
def chunk_plans(draw, max_tokens=40):
    """How a sequence is fed to a model with a cache: (chunks, compress_at). chunks: a
    prefill then prompt chunks and one-token steps, sizes summing to at most max_tokens;
    compress_at: how many chunks run before ``compress`` (None: never compressed)."""
    prefill = draw(st.integers(1, max_tokens // 2))
    chunks, left = [prefill], max_tokens - prefill
    for _ in range(draw(st.integers(0, 6))):
        if left == 0:
            break
        size = draw(st.one_of(st.just(1), st.integers(1, min(left, 9))))
        chunks.append(size)
        left -= size
    compress_at = draw(st.one_of(st.none(), st.integers(1, len(chunks))))
    return chunks, compress_at
