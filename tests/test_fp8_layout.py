"""V's layout for the FP8 kernel: the register bookkeeping of P, simulated in NumPy."""

import jax.numpy as jnp
import numpy as np
import pytest

from jzyfa import fp8_layout
from jzyfa.fp8_layout import KEY_GROUP, KEY_PERMUTATION, fp8_value_operand, physical_key


def accumulator_registers(s: np.ndarray, warp: int, lane: int) -> np.ndarray:
    """What one thread holds of a 64 x N f32 wgmma result: d[4c + e]."""
    g, t = lane // 4, lane % 4
    chunks = s.shape[1] // 8
    d = np.empty(4 * chunks, s.dtype)
    for c in range(chunks):
        for e in range(4):
            d[4 * c + e] = s[16 * warp + g + 8 * (e // 2), 8 * c + 2 * t + e % 2]
    return d


def kernel_a_fragment(d: np.ndarray, step: int) -> np.ndarray:
    """The four A registers (4 bytes each) the kernel packs for k-step `step` (keys 32 step ..)."""
    c0 = 4 * step
    pairs = [(c0, 0), (c0, 2), (c0 + 2, 0), (c0 + 2, 2)]  # (first chunk, first value) per register
    return np.array(
        [[d[4 * c + e], d[4 * c + e + 1], d[4 * (c + 1) + e], d[4 * (c + 1) + e + 1]] for c, e in pairs]
    )


def logical_a(fragments: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
    """The 64 x 32 A matrix the hardware reads from every thread's registers (PTX 8-bit A layout)."""
    a = np.full((64, KEY_GROUP), np.nan)
    for (warp, lane), regs in fragments.items():
        g, t = lane // 4, lane % 4
        for r in range(4):
            row = 16 * warp + g + 8 * (r % 2)
            for byte in range(4):
                a[row, 16 * (r // 2) + 4 * t + byte] = regs[r, byte]
    return a


def test_permutation_is_a_bijection_on_each_group():
    assert sorted(KEY_PERMUTATION.tolist()) == list(range(KEY_GROUP))
    # Register 0 of lane t holds keys 2t, 2t+1, 8+2t, 9+2t (two accumulator chunks).
    assert physical_key(np.arange(4)).tolist() == [0, 1, 8, 9]
    assert physical_key(np.arange(4, 8)).tolist() == [2, 3, 10, 11]
    assert physical_key(np.arange(16, 20)).tolist() == [16, 17, 24, 25]


@pytest.mark.parametrize("seq_k", [128, 96])
def test_packed_p_times_permuted_v_is_p_v(seq_k):
    rng = np.random.default_rng(0)
    head_dim = 16
    s = rng.standard_normal((64, seq_k))
    v = rng.standard_normal((1, seq_k, 1, head_dim)).astype(np.float32)
    vt = np.asarray(fp8_value_operand(jnp.asarray(v)))[0, 0]  # [D, Sk']
    assert vt.shape == (head_dim, fp8_layout.padded_keys(seq_k))
    out = np.zeros((64, head_dim))
    for step in range(seq_k // KEY_GROUP):
        fragments = {
            (w, lane): kernel_a_fragment(accumulator_registers(s, w, lane), step)
            for w in range(4)
            for lane in range(32)
        }
        a = logical_a(fragments)
        assert not np.isnan(a).any(), "some A element was never written"
        b = vt[:, KEY_GROUP * step : KEY_GROUP * (step + 1)].T  # B[k, n], K-major in shared memory
        out += a @ b
    np.testing.assert_allclose(out, s @ v[0, :, 0], rtol=1e-12, atol=1e-12)


def test_unpermuted_v_would_be_wrong():
    """The check above can fail: with V's keys in order, the same fragments give another product."""
    rng = np.random.default_rng(1)
    s, v = rng.standard_normal((64, 32)), rng.standard_normal((32, 8))
    fragments = {
        (w, lane): kernel_a_fragment(accumulator_registers(s, w, lane), 0)
        for w in range(4)
        for lane in range(32)
    }
    assert not np.allclose(logical_a(fragments) @ v, s @ v)


def test_padding_is_zero_and_the_layout_inverts():
    rng = np.random.default_rng(2)
    v = jnp.asarray(rng.standard_normal((2, 70, 3, 8)), jnp.float32)
    vt = fp8_value_operand(v)
    assert vt.shape == (2, 3, 8, 96)
    np.testing.assert_array_equal(np.asarray(fp8_layout.value_from_operand(vt, 70)), np.asarray(v))
    restored_padded = np.asarray(fp8_layout.value_from_operand(vt, 96))
    assert not restored_padded[:, 70:].any()


def test_e4m3_passes_through_unchanged():
    v = jnp.asarray(np.random.default_rng(3).standard_normal((1, 64, 1, 16)), jnp.float8_e4m3fn)
    vt = fp8_value_operand(v)
    assert vt.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(
        np.asarray(fp8_layout.value_from_operand(vt, 64)).view(np.uint8), np.asarray(v).view(np.uint8)
    )


def test_rank_is_checked():
    with pytest.raises(ValueError, match="v must be"):
        fp8_value_operand(jnp.zeros((4, 8, 16)))


def test_traced_permutation_equals_the_numpy_one():
    np.testing.assert_array_equal(np.asarray(fp8_layout._key_permutation()), KEY_PERMUTATION)
