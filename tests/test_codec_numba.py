"""numba fast paths equal the float64 reference: identical bytes, logits to rounding."""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import spherical_kv_ref as skv
from spherical_kv_ref import codec_numba

from strategies import CODE_BITS, DIMS, vectors


@given(dim=st.sampled_from(DIMS), bits=st.sampled_from(CODE_BITS + (16,)), data=st.data(),
       centred=st.booleans(), seed=st.integers(0, 50))
def test_fast_encode_and_logits_equal_the_reference(dim, bits, data, centred, seed):
    x = data.draw(vectors(dim=dim))
    q = data.draw(vectors(dim=dim, max_rows=5))
    codec = skv.SphericalCodec(dim, bits, seed)
    mean = x.mean(0) if centred else None
    ref, got = codec.encode(x, mean=mean), codec_numba.encode(codec, x, mean=mean)
    assert ref.codes.tobytes() == got.codes.tobytes()
    assert ref.scale.tobytes() == got.scale.tobytes()
    lr, lf = codec.logits(q, ref), codec_numba.logits(codec, q, got)
    assert np.allclose(lf, lr, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(lr).max()))
