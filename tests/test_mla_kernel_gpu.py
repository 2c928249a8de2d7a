"""MLA's head dims (q/k 192, v 128) on the 16-bit kernel, on a Hopper GPU: against float64 attention and
the pure-JAX path, outputs NaN-poisoned beforehand (donated buffers the kernel writes into), rows that see
no key (seq_q > seq_k, causal) give O = 0 and LSE = -inf, bf16 and f16, causal and not, GQA and MQA,
bitwise-identical reruns, and the FFI handler's refusal of other head-dim pairs.

Skipped without a Hopper GPU and the built extension. Runs the kernel through implementation="kernel"
(the plan's 16-bit (192, 128) dense rows). Tolerances are tests/test_kernel_gpu.py's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64
from gpu_utils import assert_bitwise_reruns, ffi_attention, kernel_call, requires_hopper
from test_kernel_gpu import LSE_TOLERANCE, O_TOLERANCE, relative_l2

import jzyfa

pytestmark = [pytest.mark.gpu, requires_hopper]

HEAD_DIM, HEAD_DIM_V = 192, 128


def mla_qkv(seed, batch, seq_q, seq_k, heads_q, heads_kv, dtype):
    rng = np.random.default_rng(seed)
    shapes = (
        (batch, seq_q, heads_q, HEAD_DIM),
        (batch, seq_k, heads_kv, HEAD_DIM),
        (batch, seq_k, heads_kv, HEAD_DIM_V),
    )
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes)


def run_poisoned(q, k, v, *, causal):
    """The kernel writing into NaN-filled, donated buffers (out [B, Sq, Hq, 128], lse): NumPy float32."""

    def call(q, k, v, out_poison, lse_poison):
        del out_poison, lse_poison  # donated: their buffers become the results
        return jzyfa.flash_attention(q, k, v, causal=causal, return_lse=True, implementation="kernel")

    b, sq, hq, _ = q.shape
    out_poison = jnp.full((b, sq, hq, HEAD_DIM_V), jnp.nan, q.dtype)
    lse_poison = jnp.full((b, hq, sq), jnp.nan, jnp.float32)
    fn = jax.jit(call, donate_argnums=(3, 4), keep_unused=True)
    hlo = fn.lower(q, k, v, out_poison, lse_poison).compile().as_text()
    kernel_call(hlo)  # one jzyfa_attention_fwd custom call
    # The poison only proves something if the kernel writes straight into the donated buffers.
    assert "input_output_alias" in hlo and " copy(" not in hlo, hlo
    out, lse = fn(q, k, v, out_poison, lse_poison)
    assert out.shape == (b, sq, hq, HEAD_DIM_V) and out.dtype == q.dtype
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


# (batch, seq_q, seq_k, heads_q, heads_kv, dtype, causal): both dtypes and masks, lengths around the
# 128-row and 128-key tiles, seq_q != seq_k both ways (bottom-right causal; seq_q > seq_k leaves the first
# rows without keys), GQA 8/2 and MQA 8/1.
CASES = [
    (1, 1, 1, 8, 2, jnp.bfloat16, True),
    (2, 63, 63, 8, 2, jnp.float16, True),
    (1, 128, 128, 8, 1, jnp.bfloat16, False),
    (2, 129, 129, 8, 2, jnp.float16, False),
    (1, 129, 1000, 8, 2, jnp.bfloat16, True),
    (1, 1000, 129, 8, 1, jnp.float16, True),  # 871 rows see no key
    (1, 1000, 63, 8, 2, jnp.bfloat16, False),
    (1, 1000, 1000, 8, 1, jnp.float16, True),
    (1, 63, 4097, 8, 2, jnp.float16, False),
    (1, 4097, 4097, 4, 1, jnp.bfloat16, True),
]


def case_id(case):
    batch, sq, sk, hq, hkv, dtype, causal = case
    return f"{jnp.dtype(dtype).name}-{'causal' if causal else 'full'}-b{batch}-{sq}x{sk}-h{hq}/{hkv}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_float64_and_the_pure_jax_path(case):
    batch, sq, sk, hq, hkv, dtype, causal = case
    q, k, v = mla_qkv(sq * 7 + sk, batch, sq, sk, hq, hkv, dtype)
    out, lse = run_poisoned(q, k, v, causal=causal)
    assert not np.isnan(out).any(), "the kernel left elements of O unwritten (NaN poison)"
    assert not np.isnan(lse).any(), "the kernel left LSE entries unwritten (NaN poison)"

    # The default scale: 1/sqrt(192), q's and k's head dim.
    want_out, want_lse = naive_attention_f64(
        *(np.asarray(x.astype(jnp.float32)) for x in (q, k, v)), causal=causal, softmax_scale=HEAD_DIM**-0.5
    )
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen, "rows with no visible key must give LSE = -inf")
    assert np.all(np.isneginf(lse[~seen])), "rows with no visible key must give LSE = -inf"
    assert np.all(out[~seen.transpose(0, 2, 1)] == 0), "rows with no visible key must give O = 0"
    if causal and sq > sk:
        assert not seen.all()  # the case does test empty rows
    err_o = relative_l2(out, want_out)
    assert err_o < O_TOLERANCE, f"relative L2 error of O {err_o:.2e}"
    if seen.any():
        err_lse = relative_l2(lse[seen], want_lse[seen])
        assert err_lse < LSE_TOLERANCE, f"relative L2 error of LSE {err_lse:.2e}"

    xla = jax.jit(
        lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=causal, return_lse=True, implementation="xla")
    )
    ref_out, ref_lse = (np.asarray(x, np.float32) for x in xla(q, k, v))
    assert relative_l2(out, ref_out) < O_TOLERANCE
    np.testing.assert_array_equal(np.isfinite(ref_lse), seen)
    if seen.any():
        assert relative_l2(lse[seen], ref_lse[seen]) < LSE_TOLERANCE


def test_bitwise_identical_reruns():
    """The same O and LSE bits over launches, with other GPU work in between."""
    q, k, v = mla_qkv(11, 2, 1000, 1000, 8, 2, jnp.bfloat16)
    fn = jax.jit(
        lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True, return_lse=True, implementation="kernel")
    )
    assert_bitwise_reruns(fn, (q, k, v), reruns=20)


def handler_call(q, k, v, *, window=(-1, -1)):
    """The FFI handler itself (no dispatch in between; gpu_utils.ffi_attention), out taking v's head dim."""
    return ffi_attention(q, k, v, softmax_scale=0.1, causal=False, window=window)


def test_handler_runs_mla_and_refuses_what_it_has_no_kernel_for():
    """InvalidArgument, not a crash, for head-dim pairs other than (64, 64), (128, 128), (256, 256) and
    (192, 128). (MLA's sliding windows: tests/test_wide_kernels_gpu.py.)"""
    q, k, v = mla_qkv(3, 1, 200, 300, 4, 2, jnp.bfloat16)
    out, lse, _ = jax.block_until_ready(handler_call(q, k, v))
    want_out, want_lse = naive_attention_f64(
        *(np.asarray(x.astype(jnp.float32)) for x in (q, k, v)), causal=False, softmax_scale=0.1
    )
    assert relative_l2(np.asarray(out.astype(jnp.float32)), want_out) < O_TOLERANCE
    assert relative_l2(np.asarray(lse), want_lse) < LSE_TOLERANCE
    with pytest.raises(Exception, match="head_dim must be 64, 128 or 256 .* got 192 for q and k, 64 for v"):
        jax.block_until_ready(handler_call(q, k, v[..., :64]))
    with pytest.raises(Exception, match="head_dim must be 64, 128 or 256 .* got 128 for q and k, 64 for v"):
        jax.block_until_ready(handler_call(q[..., :128], k[..., :128], v[..., :64]))
