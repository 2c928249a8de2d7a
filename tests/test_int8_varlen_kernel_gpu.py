"""The INT8 kernel over packed variable-length batches (precision="int8" through
`flash_attention_varlen`, and padded dense batches) on a Hopper GPU, through the FFI handler with
NaN-poisoned outputs: each sequence's rows against the dense INT8 kernel run on that sequence alone with
its own scales (a tile's key blocks and scale blocks start at its sequence's first token, so the
arithmetic is the same: bitwise), loosely against its emulation and against float64 attention on the
unquantized inputs; rows that see no key and tokens of no sequence give O = 0 and LSE = -inf; GQA,
causal or not, a sliding window; V staged in the kernel or V^T from the varlen layout pass; bitwise
reruns; the public paths; the handler's refusals.

Skipped without a Hopper GPU and the built extension. The rows are built and wait for these tests
(jzyfa.plan.BUILT_AWAITING_GPU_TESTS); the public-path tests add them for themselves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, naive_varlen_f64, offsets, random_qkv, relative_l2
from gpu_utils import assert_bitwise_reruns, ffi_attention, kernel_call, requires_hopper
from plan_rows import add_rows
from test_int8_kernel_gpu import EMULATION_TOLERANCE, FLOAT64_TOLERANCE, LSE_TOLERANCE

import jzyfa
from jzyfa import fp8_layout, int8_quant
from jzyfa._validation import mask_window
from jzyfa.int8_emulation import attention_int8_varlen_emulated

pytestmark = [pytest.mark.gpu, requires_hopper]

LENGTHS = [1, 127, 128, 129, 0, 300, 1000]  # around the 128-token scale blocks; an empty sequence
HEAD_DIM = 128


def random_packed(rng, lengths_q, lengths_k, *, heads_q=8, heads_kv=2, pad_q=0):
    """bf16 packed q [sum(lengths_q) + pad_q, Hq, D], k and v [sum(lengths_k), Hkv, D] (k with a shared
    offset to smooth away) and their offsets as NumPy int32."""
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    total_q, total_k = int(cu_q[-1]) + pad_q, int(cu_k[-1])
    q = jnp.asarray(rng.standard_normal((total_q, heads_q, HEAD_DIM)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((total_k, heads_kv, HEAD_DIM)) + rng.standard_normal(HEAD_DIM), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((total_k, heads_kv, HEAD_DIM)), jnp.bfloat16)
    return q, k, v, cu_q, cu_k


def run_poisoned(x: int8_quant.Int8Inputs, cu_q, cu_k, max_seqlens, *, causal, window, v_transposed, scale):
    """The varlen INT8 kernel through the handler into NaN-filled, donated buffers: (out, lse) float32."""
    v = fp8_layout.fp8_varlen_value_operand(x.v8, jnp.asarray(cu_k)) if v_transposed else x.v8

    def call(q8, k8, v8, cu_q, cu_k, q_scale, k_scale, descale_v, out_poison, lse_poison):
        del out_poison, lse_poison  # donated: their buffers become the results
        out, lse, _ = ffi_attention(
            q8, k8, v8, cu_seqlens=(cu_q, cu_k), max_seqlens=max_seqlens, int8_scales=(q_scale, k_scale, descale_v),
            softmax_scale=scale, causal=causal, window=window, v_transposed=v_transposed,
        )  # fmt: skip
        return out, lse

    total_q, heads_q, _ = x.q8.shape
    poison = (jnp.full((total_q, heads_q, HEAD_DIM), jnp.nan, jnp.bfloat16), jnp.full((heads_q, total_q), jnp.nan))
    args = (x.q8, x.k8, v, jnp.asarray(cu_q), jnp.asarray(cu_k), x.q_scale, x.k_scale, x.descale_v, *poison)
    fn = jax.jit(call, donate_argnums=(8, 9), keep_unused=True)
    hlo = fn.lower(*args).compile().as_text()
    assert "input_output_alias" in hlo and " copy(" not in hlo, hlo
    out, lse = fn(*args)
    return np.asarray(out, np.float32), np.asarray(lse)


def dense_kernel_per_sequence(x, cu_q, cu_k, *, causal, window, v_transposed, scale):
    """Each sequence alone through the dense INT8 kernel with its own scales: {s: (out, lse)}."""
    results = {}
    for s in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        len_q, len_k = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        if len_q == 0 or len_k == 0:
            continue
        v8 = x.v8[None, keys]
        v8 = fp8_layout.fp8_value_operand(v8) if v_transposed else v8
        scales = (x.q_scale[s : s + 1, :, : -(-len_q // 128)], x.k_scale[s : s + 1, :, : -(-len_k // 128)],
                  x.descale_v[s : s + 1])  # fmt: skip
        out, lse, _ = ffi_attention(
            x.q8[None, rows], x.k8[None, keys], v8, int8_scales=scales, softmax_scale=scale, causal=causal,
            window=window, v_transposed=v_transposed,
        )  # fmt: skip
        results[s] = (np.asarray(out[0], np.float32), np.asarray(lse[0]))
    return results


def check(rng, lengths_q, lengths_k, *, causal, window=(-1, -1), v_transposed, heads_q=8, heads_kv=2, pad_q=0,
          rotate=False):  # fmt: skip
    q, k, v, cu_q, cu_k = random_packed(rng, lengths_q, lengths_k, heads_q=heads_q, heads_kv=heads_kv, pad_q=pad_q)
    max_seqlens = (max(max(lengths_q), 1), max(max(lengths_k), 1))
    scale = HEAD_DIM**-0.5
    x = int8_quant.int8_quantize_packed(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), *max_seqlens, rotate=rotate)
    options = dict(causal=causal, window=window, v_transposed=v_transposed, scale=scale)
    out, lse = run_poisoned(x, cu_q, cu_k, max_seqlens, **options)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "an element left unwritten (NaN poison)"

    # Each sequence: the dense kernel's numbers exactly.
    for s, (want_out, want_lse) in dense_kernel_per_sequence(x, cu_q, cu_k, **options).items():
        rows = slice(cu_q[s], cu_q[s + 1])
        np.testing.assert_array_equal(out[rows], want_out, f"sequence {s}: O differs from the dense kernel's")
        np.testing.assert_array_equal(lse[:, rows], want_lse, f"sequence {s}: LSE differs from the dense kernel's")

    # The emulation on the same codes: closely.
    folded = mask_window(causal, window)
    emulated = attention_int8_varlen_emulated(
        x.q8, x.k8, x.v8, jnp.asarray(cu_q), jnp.asarray(cu_k), x.q_scale, x.k_scale, x.descale_v, *max_seqlens,
        window=folded, softmax_scale=scale,
    )  # fmt: skip
    want_out, want_lse = (np.asarray(e, np.float64) for e in emulated)
    seen = np.isfinite(want_lse)  # [Hq, total_q]: tokens of no sequence and rows with no key are not
    np.testing.assert_array_equal(np.isfinite(lse), seen, "rows with no visible key must give LSE = -inf")
    assert np.all(out[~seen.T] == 0), "rows with no visible key and tokens of no sequence must give O = 0"
    assert relative_l2(out, want_out) < EMULATION_TOLERANCE
    if seen.any():
        assert relative_l2(lse[seen], want_lse[seen]) < LSE_TOLERANCE

    # Float64 attention on the unquantized inputs: the quantization's error.
    window_f64 = None if window == (-1, -1) else window
    ref_out, _ = naive_varlen_f64(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale, window=window_f64)
    assert relative_l2(out, ref_out) < FLOAT64_TOLERANCE
    return x, cu_q, cu_k, max_seqlens, out, lse


@pytest.mark.parametrize("v_transposed", [False, True], ids=["v_staged", "v_transposed"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
def test_unequal_lengths_against_dense_kernel_emulation_and_float64(rng, causal, v_transposed):
    # 5 tokens past cu_seqlens_q[-1] belong to no sequence.
    check(rng, LENGTHS, LENGTHS, causal=causal, v_transposed=v_transposed, pad_q=5)


@pytest.mark.parametrize("v_transposed", [False, True], ids=["v_staged", "v_transposed"])
def test_sliding_window_mqa_and_sequences_without_keys(rng, v_transposed):
    # Sequence 1: keys but no query; sequence 2: queries but no key; a window neither causal nor none,
    # whose tiles start past their sequence's first key block (the K scales' block offset).
    check(rng, [100, 0, 7, 900, 1000], [300, 50, 0, 1200, 1000], causal=False, window=(200, 30),
          v_transposed=v_transposed, heads_q=4, heads_kv=1, rotate=True)  # fmt: skip


def test_reruns_are_bitwise_identical(rng):
    x, cu_q, cu_k, max_seqlens, _, _ = check(rng, LENGTHS, LENGTHS, causal=True, v_transposed=True)

    def fn(q8, k8, v8, cu_q, cu_k, *scales):
        vt = fp8_layout.fp8_varlen_value_operand(v8, cu_k)
        out, lse, _ = ffi_attention(q8, k8, vt, cu_seqlens=(cu_q, cu_k), max_seqlens=max_seqlens, int8_scales=scales,
                                    softmax_scale=0.09, causal=True, v_transposed=True)  # fmt: skip
        return out, lse

    args = (x.q8, x.k8, x.v8, jnp.asarray(cu_q), jnp.asarray(cu_k), x.q_scale, x.k_scale, x.descale_v)
    assert_bitwise_reruns(fn, args, reruns=100)


@pytest.mark.parametrize("rotate", [False, True])
def test_public_varlen_path_runs_the_kernel(rng, monkeypatch, rotate):
    """flash_attention_varlen(precision="int8") on a Hopper GPU: one program with the INT8 varlen custom
    call, no device quantization kernel (XLA ops quantize packed batches), close to the emulation path."""
    add_rows(monkeypatch, "int8", (HEAD_DIM, HEAD_DIM), layouts=("varlen",))  # built, planned or not yet
    q, k, v, cu_q, cu_k = random_packed(rng, [300, 0, 1000, 129], [500, 64, 1000, 129], heads_q=8, heads_kv=2)
    cu_q, cu_k = jnp.asarray(cu_q), jnp.asarray(cu_k)
    call = lambda implementation: jax.jit(lambda q, k, v, cu_q, cu_k: jzyfa.flash_attention_varlen(
        q, k, v, cu_q, cu_k, 1000, 1000, causal=True, precision="int8", rotate=rotate, return_lse=True,
        implementation=implementation))  # fmt: skip
    run = call("kernel")
    custom_call = kernel_call(run.lower(q, k, v, cu_q, cu_k).compile().as_text())
    assert f"s8[{q.shape[0]},8,128]" in custom_call and "varlen = true" in custom_call, custom_call
    out, lse = run(q, k, v, cu_q, cu_k)
    want_out, want_lse = call("xla")(q, k, v, cu_q, cu_k)
    assert out.dtype == q.dtype
    assert relative_l2(np.asarray(out, np.float64), np.asarray(want_out, np.float64)) < EMULATION_TOLERANCE
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert relative_l2(np.asarray(lse)[finite], np.asarray(want_lse)[finite]) < LSE_TOLERANCE


def test_public_padded_path_runs_the_kernel(rng, monkeypatch):
    """flash_attention(precision="int8", seqlens_q=..., seqlens_k=...): the padded batch as a packed one on
    the varlen kernel; padded rows give 0 and -inf; close to the emulation path and to float64."""
    add_rows(monkeypatch, "int8", (HEAD_DIM, HEAD_DIM), layouts=("varlen",))
    q, k, v = random_qkv(rng, batch=3, seq_q=600, seq_k=800, heads_q=8, heads_kv=2, head_dim=HEAD_DIM)
    seqlens_q, seqlens_k = jnp.asarray([600, 1, 300], jnp.int32), jnp.asarray([800, 129, 0], jnp.int32)
    call = lambda implementation: jax.jit(lambda q, k, v, lq, lk: jzyfa.flash_attention(
        q, k, v, causal=True, precision="int8", seqlens_q=lq, seqlens_k=lk, return_lse=True,
        implementation=implementation))  # fmt: skip
    run = call("kernel")
    assert "varlen = true" in kernel_call(run.lower(q, k, v, seqlens_q, seqlens_k).compile().as_text())
    out, lse = (np.asarray(r, np.float64) for r in run(q, k, v, seqlens_q, seqlens_k))
    want_out, want_lse = (np.asarray(r, np.float64) for r in call("xla")(q, k, v, seqlens_q, seqlens_k))
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert np.all(np.swapaxes(out, 1, 2)[~finite] == 0)
    assert relative_l2(out, want_out) < EMULATION_TOLERANCE
    assert relative_l2(lse[finite], want_lse[finite]) < LSE_TOLERANCE
    ref_out, _ = naive_attention_f64(q[:1], k[:1], v[:1], causal=True, softmax_scale=HEAD_DIM**-0.5)
    assert relative_l2(out[:1], ref_out) < FLOAT64_TOLERANCE  # the full row


def test_handler_refuses_bad_int8_varlen_operands(rng):
    """InvalidArgument naming the operand and its varlen shape, never a launch on wrong shapes."""
    q, k, v, cu_q, cu_k = random_packed(rng, [300, 5], [200, 7], heads_q=4, heads_kv=2)
    x = int8_quant.int8_quantize_packed(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), 300, 200)
    cu = (jnp.asarray(cu_q), jnp.asarray(cu_k))
    scales = (x.q_scale, x.k_scale, x.descale_v)
    run = lambda *scales, max_seqlens=(300, 200), v=x.v8, **kw: jax.block_until_ready(
        ffi_attention(x.q8, x.k8, v, cu_seqlens=cu, max_seqlens=max_seqlens, int8_scales=scales, **kw)
    )
    with pytest.raises(Exception, match=r"q_scale must be float32 \[2, 4, 3\], got \[2, 4, 2\]"):
        run(x.q_scale[..., :2], *scales[1:])
    with pytest.raises(Exception, match=r"q_scale must be float32 \[2, 4, 4\]"):  # the maxima set the blocks
        run(*scales, max_seqlens=(500, 200))
    with pytest.raises(Exception, match=r"descale_v must be float32 \[2, 2\]"):
        run(x.q_scale, x.k_scale, x.descale_v[:1])
    with pytest.raises(Exception, match="vt must hold roundup32"):
        run(*scales, v=fp8_layout.fp8_varlen_value_operand(x.v8, cu[1])[..., :-32], v_transposed=True)
    with pytest.raises(Exception, match="head_dim must be 128 for q, k and v for the jzyfa INT8 varlen kernel"):
        jax.block_until_ready(ffi_attention(
            x.q8[..., :64], x.k8[..., :64], x.v8[..., :64], cu_seqlens=cu, max_seqlens=(300, 200),
            int8_scales=scales,
        ))  # fmt: skip
