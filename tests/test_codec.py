"""SphericalCodec: format, bytes, determinism, input validation, and the error analysis
of docs/ada.md (deterministic bound on every input; expected error over rotations)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spherical_kv_ref as skv
from spherical_kv_ref.rotation import VALUE_SALT, Rotation, hadamard_transform

from strategies import ALL_BITS, CODE_BITS, DIMS, codec_params, vectors


def test_bytes_per_vector_match_the_design():
    assert skv.SphericalCodec(128, 4).bytes_per_vector == 64 + 2
    assert skv.SphericalCodec(128, 3).bytes_per_vector == 48 + 2
    assert skv.SphericalCodec(128, 2).bytes_per_vector == 32 + 2
    assert skv.SphericalCodec(128, 16).bytes_per_vector == 256
    enc = skv.SphericalCodec(128, 4).encode(np.ones((5, 128)))
    assert enc.codes.shape == (5, 16) and enc.codes.dtype == np.uint32
    assert enc.scale.dtype == np.float16 and enc.nbytes == 5 * 66


@pytest.mark.parametrize("dim", DIMS)
def test_rotation_is_orthogonal_and_inverse_is_its_transpose(dim):
    r = Rotation(dim, seed=3, layer=2, head=1)
    p = r.dense()
    assert np.allclose(p @ p.T, np.eye(dim), atol=1e-12)
    x = np.random.default_rng(0).standard_normal((4, dim))
    assert np.allclose(r.inverse(r.apply(x)), x, atol=1e-12)


def test_hadamard_transform_matches_the_sylvester_matrix():
    d = 16
    i = np.arange(d)
    h = (-1.0) ** np.array([[bin(a & b).count("1") for b in i] for a in i])
    x = np.random.default_rng(1).standard_normal((3, d))
    assert np.allclose(hadamard_transform(x), x @ h.T, atol=1e-12)


@given(codes=st.data(), bits=st.sampled_from(CODE_BITS), dim=st.sampled_from(DIMS + (40,)))
def test_pack_unpack_round_trip(codes, bits, dim):
    n = codes.draw(st.integers(1, 5))
    c = np.array(codes.draw(st.lists(st.integers(0, 2 ** bits - 1), min_size=n * dim,
                                     max_size=n * dim))).reshape(n, dim)
    words = skv.pack_codes(c, bits)
    assert words.shape == (n, skv.code_words(bits, dim))
    assert np.array_equal(skv.unpack_codes(words, bits, dim), c)


def test_packing_layout_is_little_endian_fields():
    c = np.arange(8).reshape(1, 8) % 16
    assert skv.pack_codes(np.tile(c, (1, 4)), 4)[0, 0] == 0x76543210
    c3 = np.array([[7, 0, 5] + [0] * 29])
    w = skv.pack_codes(c3, 3)
    assert w[0, 0] == (3 | (1 << 4)) and w[0, 2] == (1 | (1 << 2))


@given(p=codec_params(), x=vectors())
def test_same_seed_same_bytes(p, x):
    if x.shape[1] != p["dim"]:
        x = np.resize(x, (x.shape[0], p["dim"]))
    a = skv.SphericalCodec(**p).encode(x)
    b = skv.SphericalCodec(**p).encode(x.copy())
    assert a.scale.tobytes() == b.scale.tobytes() and a.codes.tobytes() == b.codes.tobytes()


def test_different_layers_heads_and_salts_get_different_rotations():
    signs = {tuple(skv.SphericalCodec(64, 4, 0, layer=l, head=h, salt=s).signs)
             for l in range(3) for h in range(3) for s in range(2)}
    assert len(signs) == 18


@given(p=codec_params(), data=st.data(), centred=st.booleans())
@settings(max_examples=60)
def test_deterministic_logit_bound_holds_for_every_pair(p, data, centred):
    x = data.draw(vectors(dim=p["dim"]))
    q = data.draw(vectors(dim=p["dim"], max_rows=4))
    codec = skv.SphericalCodec(**p)
    mean = x.mean(axis=0) if centred else None
    enc = codec.encode(x, mean=mean)
    err = np.abs(q @ x.T - codec.logits(q, enc))
    bound = codec.logit_error_bound(q, enc)
    assert np.all(err <= bound), (err - bound).max()


@given(p=codec_params(bits=CODE_BITS), x=vectors())
def test_angle_error_is_within_its_code_only_bound(p, x):
    x = np.resize(x, (x.shape[0], p["dim"]))
    codec = skv.SphericalCodec(**p)
    enc = codec.encode(x)
    assert np.all(codec.angle_error(x, enc) <= codec.max_angle_error(enc))


def test_bound_is_not_vacuous_on_gaussian_data():
    rng = np.random.default_rng(0)
    codec = skv.SphericalCodec(128, 4)
    x, q = rng.standard_normal((300, 128)), rng.standard_normal((4, 128))
    enc = codec.encode(x)
    eps_max = codec.max_angle_error(enc)
    # the cell-geometry bound on the angle error is within a small factor of the truth
    assert np.median(eps_max / codec.angle_error(x, enc)) < 6
    rel = codec.logit_error_bound(q, enc) / (np.linalg.norm(q, axis=1)[:, None] * np.linalg.norm(x, axis=1))
    assert rel.max() < 0.6


@pytest.mark.parametrize("bits", ALL_BITS)
def test_zero_vectors_encode_to_a_defined_code_with_logit_zero(bits):
    codec = skv.SphericalCodec(64, bits)
    x = np.zeros((3, 64))
    x[1] = 1.0
    enc = codec.encode(x)
    q = np.random.default_rng(0).standard_normal((2, 64))
    lg = codec.logits(q, enc)
    assert np.all(lg[:, [0, 2]] == 0.0)
    if bits != 16:
        assert enc.scale[0] == 0 and np.all(enc.codes[0] == 0)
    mu = np.full(64, 0.25)
    enc_c = codec.encode(np.tile(mu, (2, 1)), mean=mu)    # x == μ → centred vector is zero
    assert np.allclose(codec.logits(q, enc_c), (q @ mu.astype(np.float32))[:, None], rtol=1e-12)


@pytest.mark.parametrize("bad,match", [
    (np.array([[np.nan] + [0.0] * 63]), "NaN or Inf"),
    (np.array([[np.inf] + [0.0] * 63]), "NaN or Inf"),
    (np.zeros((3, 63)), r"shape \(n, 64\)"),
    (np.zeros(64), r"shape \(n, 64\)"),
    (np.zeros((2, 64), dtype=complex), "dtype"),
    (np.array([["a"] * 64]), "dtype"),
    (np.zeros((2, 64), dtype=bool), "dtype"),
])
def test_bad_input_raises_value_error_naming_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        skv.SphericalCodec(64, 4).encode(bad)


def test_fp16_overflow_is_refused_not_silent():
    with pytest.raises(ValueError, match="fp16"):
        skv.SphericalCodec(64, 4).encode(np.full((1, 64), 1e5))
    with pytest.raises(ValueError, match="fp16"):
        skv.SphericalCodec(64, 16).encode(np.full((1, 64), 1e5))


def test_codec_rejects_foreign_encoded_and_bad_arguments():
    enc = skv.SphericalCodec(64, 4).encode(np.ones((2, 64)))
    with pytest.raises(ValueError, match="bits=4"):
        skv.SphericalCodec(64, 3).logits(np.ones((1, 64)), enc)
    with pytest.raises(ValueError, match="bits"):
        skv.SphericalCodec(64, 5)
    with pytest.raises(ValueError, match="dim"):
        skv.SphericalCodec(2, 4)
    with pytest.raises(ValueError, match="mean"):
        skv.SphericalCodec(64, 4).encode(np.ones((2, 64)), mean=np.ones(63))



@pytest.mark.parametrize("other", [dict(seed=1), dict(layer=2), dict(head=1), dict(salt=VALUE_SALT),
                                   dict(codebook="uniform"), dict(rotation="haar")])
def test_codes_remember_their_codec_and_another_codec_refuses_them(other):
    """Codes read with another rotation or codebook would give wrong logits, not an error:
    Encoded records the codec's seed, dim, bits and the rest of its key."""
    x, q = np.random.default_rng(0).standard_normal((2, 5, 64))
    enc = skv.SphericalCodec(64, 4, seed=7).encode(x)
    assert (enc.seed, enc.dim, enc.bits) == (7, 64, 4)
    assert enc.take([0, 2]).codec_key == enc.codec_key
    kw = dict(seed=7) | other
    with pytest.raises(ValueError, match=f"another codec: {next(iter(other))}="):
        skv.SphericalCodec(64, 4, **kw).logits(q, enc)
    skv.SphericalCodec(64, 4, seed=7).logits(q, enc)          # its own codec reads it
    # codes put together from pages carry no key and are not checked
    bare = skv.Encoded(enc.scale, enc.codes, enc.bits, enc.dim)
    assert bare.seed is None and skv.SphericalCodec(64, 4, seed=1).logits(q, bare).shape == (5, 5)

def test_mean_is_recorded_as_float32_and_subtracted():
    rng = np.random.default_rng(2)
    x, mu, q = rng.standard_normal((9, 64)), rng.standard_normal(64), rng.standard_normal((3, 64))
    codec = skv.SphericalCodec(64, 4)
    enc = codec.encode(x, mean=mu)
    assert enc.mean.dtype == np.float32 and np.array_equal(enc.mean, mu.astype(np.float32))
    plain = codec.encode(x - mu.astype(np.float32).astype(np.float64))
    assert np.array_equal(plain.codes, enc.codes) and np.array_equal(plain.scale, enc.scale)
    # logits differ exactly by the per-query constant q·μ, which softmax ignores
    diff = codec.logits(q, enc) - codec.logits(q, plain)
    assert np.allclose(diff, (q @ enc.mean.astype(np.float64))[:, None], rtol=1e-12, atol=1e-12)


def test_decode_has_the_true_norm_and_the_quantised_direction():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((50, 128))
    codec = skv.SphericalCodec(128, 4)
    xh = codec.decode(codec.encode(x))
    assert np.allclose(np.linalg.norm(xh, axis=1), np.linalg.norm(x, axis=1), rtol=2e-3)
    cos = np.sum(x * xh, axis=1) / np.linalg.norm(x, axis=1) / np.linalg.norm(xh, axis=1)
    assert np.all(cos > 0.98)


def _empirical_over_rotations(bits, dim, q, k, rotation, n_rot):
    se = np.zeros((q.shape[0], k.shape[0]))
    for seed in range(n_rot):
        codec = skv.SphericalCodec(dim, bits, seed=seed, rotation=rotation)
        se += (q @ k.T - codec.logits(q, codec.encode(k))) ** 2
    return se / n_rot, codec


@pytest.mark.parametrize("bits", (1, 2, 3, 4))
@pytest.mark.parametrize("dim", (64, 128))
def test_expected_squared_logit_error_matches_random_hadamard_rotations(bits, dim):
    rng = np.random.default_rng(100 + bits)
    q, k = rng.standard_normal((6, dim)), rng.standard_normal((40, dim)) * 3
    emp, codec = _empirical_over_rotations(bits, dim, q, k, "hadamard", 150)
    pred = codec.expected_sq_logit_error(q, k)
    assert abs(emp.sum() / pred.sum() - 1) < 0.10
    # the large-d form ‖q‖²‖k‖²E[ε²]/d is the same to within a few per cent
    approx = np.outer(np.sum(q * q, 1), np.sum(k * k, 1)) * codec.expected_sq_angle_error / dim
    assert abs(approx.sum() / pred.sum() - 1) < 0.05


@pytest.mark.parametrize("bits", (2, 4))
def test_expected_error_is_exact_for_haar_rotations_even_on_adversarial_keys(bits):
    dim = 64
    rng = np.random.default_rng(7)
    k = np.zeros((8, dim))
    k[:, 0] = 50.0                      # one huge channel: the worst case for a fixed basis
    k[:4, 1] = 5.0
    q = np.zeros((3, dim))
    q[0, 0] = 1.0                       # q parallel to the key
    q[1] = rng.standard_normal(dim)
    q[2, 5] = 2.0                       # q orthogonal to the key
    emp, codec = _empirical_over_rotations(bits, dim, q, k, "haar", 400)
    pred = codec.expected_sq_logit_error(q, k)
    assert abs(emp.sum() / pred.sum() - 1) < 0.10


def test_torch_tensors_in_any_float_dtype_encode_as_their_float32_values():
    """A serving engine hands over bfloat16 tensors: they are upcast (exactly) to float32,
    on the host, without the reference importing torch; gradients do not get in the way."""
    torch = pytest.importorskip("torch")
    codec = skv.SphericalCodec(64, 4, seed=3)
    x = torch.randn(7, 64, dtype=torch.bfloat16, requires_grad=True)
    want = codec.encode(x.detach().float().numpy())
    for t in (x, x.half(), x.float(), x.detach().double()):
        got = codec.encode(t)
        np.testing.assert_array_equal(got.codes, want.codes)
        np.testing.assert_array_equal(got.scale, want.scale)
    q = torch.randn(2, 64, dtype=torch.bfloat16)
    np.testing.assert_array_equal(codec.logits(q, want), codec.logits(q.float().numpy(), want))
    with pytest.raises(ValueError, match="x must be a real float array"):
        codec.encode(torch.zeros(3, 64, dtype=torch.complex64))
