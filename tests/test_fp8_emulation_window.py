"""Sliding windows in the FP8 emulation (jzyfa.fp8_emulation): the oracle a windowed FP8 kernel is tested against.

The windowed kernel (16-bit: ffi/flash_fwd_kernel.cuh, WindowBlocks and MaskWindow) visits, for each
128-row query tile, only the key blocks from first_block to the last block its windows reach, aligned
to multiples of 128 keys. The emulation visits every block for every row; a block with no visible key
for a row must then leave that row's r, l and O untouched, so both give the same result. These tests
check the window against float64, the mask conventions bit for bit, and that equivalence tile by tile.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, visible_f64
from test_fp8_emulation import dequantized, quantize_all, relative_error

from jzyfa import _validation
from jzyfa.fp8_emulation import (
    P_EXPONENT,
    BLOCK_N,
    Fp8Options,
    _next_reference,
    attention_fp8_emulated,
    trace_attention_fp8_emulated,
)

WINDOWS = [(0, 0), (1, 0), (127, 0), (128, 0), (64, 64), (-1, 5), (300, -1), (0, -1)]
LENGTHS = [(200, 200), (70, 300), (160, 100)]  # (Sq, Sk): square, chunk Sq < Sk, Sq > Sk


def inputs(rng, seq_q, seq_k, *, heads_q=2, heads_kv=1, head_dim=64):
    q = rng.standard_normal((1, seq_q, heads_q, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((1, seq_k, heads_kv, head_dim)).astype(np.float32) for _ in range(2))
    return quantize_all(q, k, v)


def as_f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def assert_masked_blocks_are_no_ops(trace, seq_q, seq_k, window):
    """Where a block has no visible key for a row, r stays what it was and O is not rescaled."""
    visible = visible_f64(seq_q, seq_k, causal=False, window=window)
    blocks = -(-seq_k // BLOCK_N)
    visible = np.pad(visible, ((0, 0), (0, blocks * BLOCK_N - seq_k)))
    masked = ~visible.reshape(seq_q, blocks, BLOCK_N).any(-1)  # [Sq, blocks]
    r = np.asarray(trace.reference_exponent)  # [B, Hq, Sq, blocks]
    before = np.concatenate([np.full(r.shape[:-1] + (1,), -np.inf, r.dtype), r[..., :-1]], axis=-1)
    masked = np.broadcast_to(masked, r.shape)
    np.testing.assert_array_equal(r[masked], before[masked])
    assert not np.asarray(trace.rescaled)[masked].any()
    return masked


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("lean_p", [True, False])
def test_windows_against_float64(rng, window, lean_p):
    # The tolerances of test_fp8_emulation.test_shapes_against_float64 (causal and no mask there).
    for seq_q, seq_k in LENGTHS:
        quantized = inputs(rng, seq_q, seq_k)
        trace = trace_attention_fp8_emulated(*quantized, causal=False, window=window, lean_p=lean_p)
        out, lse = trace.out, trace.lse
        assert out.dtype == jnp.bfloat16 and out.shape == (1, seq_q, 2, 64) and lse.shape == (1, 2, seq_q)
        reference, reference_lse = naive_attention_f64(*dequantized(*quantized), causal=False, window=window)
        empty = np.isneginf(reference_lse)
        # Rows that see no key: O = 0, LSE = -inf (here: Sq > Sk, rows before the first key).
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty)
        out = as_f32(out)
        assert np.isfinite(out).all() and not np.any(out[np.swapaxes(empty, 1, 2)])
        assert relative_error(out, reference) < (0.06 if lean_p else 0.05), (seq_q, seq_k)
        lse_error = np.asarray(lse)[~empty] - reference_lse[~empty]
        low, high = (
            (math.log(0.957), math.log(1.108)) if lean_p else (math.log(1 - 1 / 17), math.log(1 + 1 / 17))
        )
        assert low - 1e-5 < lse_error.min() and lse_error.max() < high + 1e-5, (seq_q, seq_k)
        assert_masked_blocks_are_no_ops(trace, seq_q, seq_k, window)
        assert empty.any() == (0 <= window[1] < seq_q - seq_k)  # rows at positions below -right


@pytest.mark.parametrize("lean_p", [True, False])
def test_mask_conventions_bit_for_bit(rng, lean_p):
    for seq_q, seq_k in LENGTHS:
        quantized = inputs(rng, seq_q, seq_k)

        def run(quantized=quantized, **mask):
            out, lse = attention_fp8_emulated(*quantized, lean_p=lean_p, out_dtype=jnp.float32, **mask)
            return as_f32(out), np.asarray(lse)

        def same(a, b):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)

        # (-1, 0) is causal; causal=True with a window sets its right bound to 0.
        causal = run(causal=True)
        same(run(causal=False, window=(-1, 0)), causal)
        same(run(causal=True, window=(-1, 7)), causal)
        same(run(causal=True, window=(5, 9)), run(causal=False, window=(5, 0)))
        # A window wider than all keys, on either side, is no mask.
        none = run(causal=False)
        for wide in ((-1, -1), (seq_k + seq_q, seq_k + seq_q), (seq_k - 1, seq_q - 1)):
            same(run(causal=False, window=wide), none)


def test_rows_without_keys(rng):
    # Sq > Sk: rows 0 .. Sq - Sk - 1 sit at negative positions p and, with right bound 0, see no
    # key; every later row sees at least key p.
    seq_q, seq_k = 300, 140
    quantized = inputs(rng, seq_q, seq_k)
    for window in ((3, 0), (0, 0), (200, 0)):
        out, lse = attention_fp8_emulated(*quantized, causal=False, window=window)
        lse = np.asarray(lse)
        assert np.isneginf(lse[..., : seq_q - seq_k]).all() and np.isfinite(lse[..., seq_q - seq_k :]).all()
        np.testing.assert_array_equal(as_f32(out)[:, : seq_q - seq_k], 0.0)


@pytest.mark.parametrize("integer_reference", [True, False])
def test_next_reference_keeps_r_on_a_fully_masked_block(integer_reference):
    # A row whose r sits high (a large score earlier), then a block far below: block scaling lowers r
    # (hysteresis and the MAX_BLOCK_EXPONENT floor). A block with no visible key (block_max = -inf)
    # would pass the same test, -inf < r + E - H, and must not: the kernel's
    # `change &= block_max > -INFINITY` (NextReference in ffi/fp8_softmax.cuh).
    options = Fp8Options(lean_p=integer_reference, integer_reference=integer_reference)
    r, running_max = jnp.float32(12.0), jnp.float32(20.0)
    low = _next_reference(r, running_max, jnp.float32(-1e30), options)
    assert float(low) < float(r)  # a visible but tiny block moves r down to the floor
    assert float(low) == float(jnp.ceil(running_max) if integer_reference else running_max) - P_EXPONENT - 32
    masked = _next_reference(r, running_max, jnp.float32(-jnp.inf), options)
    assert float(masked) == float(r)
    fresh = _next_reference(jnp.float32(-jnp.inf), jnp.float32(-jnp.inf), jnp.float32(-jnp.inf), options)
    assert float(fresh) == -math.inf  # before the first visible key too


def window_blocks(q_first, q_last, diagonal, seq_k, left, right):
    """WindowBlocks of ffi/flash_fwd_common.cuh: (kv_begin, kv_end, first_block, num_blocks) of a tile."""
    kv_begin = 0 if left < 0 else max(q_first + diagonal - left, 0)
    kv_end = seq_k if right < 0 else min(q_last + diagonal + right + 1, seq_k)
    if kv_end <= kv_begin:
        return kv_begin, kv_end, 0, 0
    first = kv_begin // BLOCK_N
    return kv_begin, kv_end, first, -(-kv_end // BLOCK_N) - first


TILE_CASES = {  # (Sq, Sk, window, a large key at): every row of a tile shares its blocks
    "sliding (200, 0), Sq < Sk": (256, 700, (200, 0), 300),
    "band (64, 64), square": (384, 384, (64, 64), 0),
    "band (130, 10), Sq > Sk, empty rows": (400, 300, (130, 10), 150),
    "left unbounded (-1, 5)": (300, 520, (-1, 5), 250),
    "right unbounded (300, -1)": (260, 650, (300, -1), 500),
}


@pytest.mark.parametrize("case", TILE_CASES)
@pytest.mark.parametrize("lean_p", [True, False])
def test_equals_a_kernel_visiting_only_its_tiles_blocks(rng, case, lean_p):
    # For each 128-row tile, run the emulation on the tile's rows and only the keys the kernel loads
    # for it (from first_block * 128 to the tile's last reachable key, with the window shifted to the
    # new alignment): output, LSE and the reference exponents of those blocks equal the full run's bit
    # for bit; the full run's r is -inf before first_block and constant after the tile's blocks. A
    # large key (about 20 log2 units above the rest) makes block scaling act, so rows carry a high r
    # into blocks their window no longer reaches, where an unguarded r update would lower it.
    seq_q, seq_k, (left, right), sink = TILE_CASES[case]
    q = rng.standard_normal((1, seq_q, 2, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, seq_k, 2, 64)).astype(np.float32) for _ in range(2))
    direction = rng.standard_normal(64)
    direction /= np.linalg.norm(direction)
    q += 6 * direction
    k[:, sink] = 2.0 * math.sqrt(64) * direction
    q8, k8, v8, dq, dk, dv = quantize_all(q, k, v)
    options = {"lean_p": lean_p, "out_dtype": jnp.float32}
    full = trace_attention_fp8_emulated(q8, k8, v8, dq, dk, dv, causal=False, window=(left, right), **options)
    r_full = np.asarray(full.reference_exponent)
    masked = assert_masked_blocks_are_no_ops(full, seq_q, seq_k, (left, right))
    lowered = (r_full[..., 1:] < r_full[..., :-1]) & np.isfinite(r_full[..., :-1])
    assert masked.any() and lowered.any()  # blocks out of reach, and r moved down by block scaling
    diagonal = seq_k - seq_q
    for t0 in range(0, seq_q, 128):
        t1 = min(t0 + 128, seq_q)
        kv_begin, kv_end, first, count = window_blocks(t0, t1 - 1, diagonal, seq_k, left, right)
        rows = slice(t0, t1)
        if count == 0:  # the kernel writes O = 0, LSE = -inf for the whole tile
            np.testing.assert_array_equal(as_f32(full.out)[:, rows], 0.0)
            assert np.isneginf(np.asarray(full.lse)[..., rows]).all()
            continue
        assert first * BLOCK_N <= kv_begin < (first + 1) * BLOCK_N  # blocks aligned to 128 keys
        keys = slice(first * BLOCK_N, kv_end)
        shift = diagonal + t1 - kv_end  # position in the tile's call = position - first key - shift
        window = (left - shift if left >= 0 else -1, right + shift if right >= 0 else -1)
        assert min(window) >= -1
        tile = trace_attention_fp8_emulated(
            q8[:, rows], k8[:, keys], v8[:, keys], dq, dk, dv, causal=False, window=window, **options
        )
        np.testing.assert_array_equal(as_f32(tile.out), as_f32(full.out)[:, rows])
        np.testing.assert_array_equal(np.asarray(tile.lse), np.asarray(full.lse)[..., rows])
        r = r_full[:, :, rows]
        np.testing.assert_array_equal(np.asarray(tile.reference_exponent), r[..., first : first + count])
        assert np.isneginf(r[..., :first]).all()
        after = r[..., first + count :]
        np.testing.assert_array_equal(after, np.broadcast_to(r[..., first + count - 1, None], after.shape))


def test_window_argument_errors():
    x8 = jnp.zeros((1, 8, 2, 64), jnp.float8_e4m3fn)
    one = jnp.float32(1)
    with pytest.raises(ValueError, match="left bound"):
        attention_fp8_emulated(x8, x8, x8, one, one, one, causal=False, window=(-2, 0))
    with pytest.raises(TypeError, match="window"):
        attention_fp8_emulated(x8, x8, x8, one, one, one, causal=False, window=4)
    assert _validation.mask_window(True, (3, 9)) == (3, 0)
