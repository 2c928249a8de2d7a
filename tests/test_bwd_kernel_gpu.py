"""The backward custom call `jzyfa_attention_bwd` (ffi/flash_bwd_dkdv.cuh, ffi/flash_bwd_dq.cuh) on a Hopper
GPU, called directly through jax.ffi.ffi_call on fresh random inputs against float64 gradients: dq, dk, dv
within relative L2 2e-2, results written into NaN-filled donated buffers so every element must be
written; bitwise reruns; and jax.grad of jzyfa.flash_attention through the public path."""

from __future__ import annotations

import numpy as np
import pytest
from attention_oracle import (
    naive_attention_f64,
    naive_attention_grads_f64,
    naive_varlen_f64,
    random_qkv,
    relative_l2,
)
from gpu_utils import assert_bitwise_reruns, requires_hopper
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax
import jax.numpy as jnp

pytestmark = [pytest.mark.gpu, requires_hopper]

TOLERANCE = 2e-2
# (q and k, v) head dims of the plan's backward rows; MLA's 192/128 splits the dK/dV kernel's columns
# unevenly between its consumers (ffi/tile_size.h).
HEAD_DIMS = [(128, 128), (64, 64), (256, 256), (192, 128)]
HEAD_DIM_IDS = ["128", "64", "256", "192x128"]


def bwd_call(
    q, k, v, dout, lse, delta, *, causal: bool, softmax_scale: float, window=(-1, -1), varlen=None, softcap=0.0
):
    """dq, dk, dv from the custom call (the contract's operands only), written into NaN-filled donated
    buffers of the results' shapes (the repository's poisoning pattern: XLA reuses a donated buffer of
    the same shape and dtype for the result)."""
    from jzyfa import _extension

    assert _extension.extension_loaded()
    call = jax.ffi.ffi_call(
        "jzyfa_attention_bwd",
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct((2,), jnp.int32),
        ),
    )

    # varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), the packed layout's operands.
    cu = () if varlen is None else tuple(jnp.asarray(c, jnp.int32) for c in varlen[:2])
    max_q, max_k = (0, 0) if varlen is None else varlen[2:]

    def run(q, k, v, dout, lse, delta, cu, dq_poison, dk_poison, dv_poison):
        del dq_poison, dk_poison, dv_poison
        dq, dk, dv, _ = call(
            q, k, v, dout, lse, delta, *cu,
            softmax_scale=np.float32(softmax_scale), causal=causal, window_left=np.int64(window[0]),
            window_right=np.int64(window[1]), varlen=varlen is not None, max_seqlen_q=np.int64(max_q),
            max_seqlen_k=np.int64(max_k), softcap=np.float32(softcap),
        )  # fmt: skip
        return dq, dk, dv

    poison = [jnp.full(x.shape, jnp.nan, x.dtype) for x in (q, k, v)]
    return jax.jit(run, donate_argnums=(7, 8, 9))(q, k, v, dout, lse, delta, cu, *poison)


def residuals(q, k, v, dout, *, causal: bool, scale: float, window=None):
    """lse (float32, from float64) and delta = rowsum(dout * out) in float64, as the JAX side computes them."""
    out, lse = naive_attention_f64(q, k, v, causal=causal, softmax_scale=scale, window=window)
    delta = np.einsum("bshd,bshd->bhs", np.asarray(dout, np.float64), out)
    return jnp.asarray(lse, jnp.float32), jnp.asarray(delta, jnp.float32)


def check(
    seq_q,
    seq_k,
    *,
    heads_q=2,
    heads_kv=None,
    head_dims=(128, 128),
    dtype=jnp.bfloat16,
    causal=True,
    batch=1,
    seed=0,
    window=None,
):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv,
                         head_dim=head_dims[0], head_dim_v=head_dims[1], dtype=dtype)  # fmt: skip
    dout = jnp.asarray(rng.standard_normal(q.shape[:-1] + v.shape[-1:]), dtype)
    scale = 1 / np.sqrt(head_dims[0])
    lse, delta = residuals(q, k, v, dout, causal=causal, scale=scale, window=window)
    dq, dk, dv = bwd_call(
        q, k, v, dout, lse, delta, causal=causal, softmax_scale=scale, window=window or (-1, -1)
    )
    want = naive_attention_grads_f64(q, k, v, dout, causal=causal, softmax_scale=scale, window=window)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all(), f"{name}: NaN or inf (an element left unwritten?)"
        if not np.any(ref):
            # Exactly 0 in float64 where each row sees one key (dS = P (dP - delta) with P = 1, dP =
            # delta); the kernel's dP (bf16 operands, float32 sums) and delta differ by rounding.
            assert np.abs(got).max() < 1e-4, f"{name}: {np.abs(got).max():.3g} where float64 gives 0"
            continue
        err = relative_l2(got, ref)
        assert err < TOLERANCE, f"{name}: relative L2 {err:.3g}"


@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=HEAD_DIM_IDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "none"])
@pytest.mark.parametrize("length", [1, 127, 129, 1000])
def test_square_lengths(head_dims, dtype, causal, length):
    check(length, length, head_dims=head_dims, dtype=dtype, causal=causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "none"])
@pytest.mark.parametrize(
    ("seq_q", "seq_k"), [(300, 1000), (1000, 300), (1, 777), (777, 1), (64, 65), (200, 129)]
)
def test_unequal_lengths(seq_q, seq_k, causal):
    """Sq > Sk causal leaves the first Sq - Sk rows seeing no key (lse = -inf, dq = 0)."""
    check(seq_q, seq_k, causal=causal)


@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=HEAD_DIM_IDS)
@pytest.mark.parametrize(("heads_q", "heads_kv"), [(2, 2), (4, 2), (8, 1), (16, 2), (5, 1)])
def test_gqa_and_mqa(heads_q, heads_kv, head_dims):
    check(333, 517, heads_q=heads_q, heads_kv=heads_kv, head_dims=head_dims, batch=2)


@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=HEAD_DIM_IDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "none"])
@pytest.mark.parametrize(
    ("seq_q", "seq_k", "window"),
    [
        (1000, 1000, (100, 50)),
        (1000, 1000, (0, 0)),
        (700, 900, (300, -1)),
        (900, 700, (-1, 200)),
        (513, 2000, (1, 257)),
    ],
)
def test_windows(seq_q, seq_k, window, causal, head_dims):
    """Sliding windows (jzyfa's convention: query i at p = i + Sk - Sq sees keys p - left .. p + right; causal
    sets right to 0), rows that see no key included (their dq is 0)."""
    check(seq_q, seq_k, causal=causal, window=window, head_dims=head_dims, heads_q=4, heads_kv=2)


@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=HEAD_DIM_IDS)
@pytest.mark.parametrize("mask", ["causal", "none", "window"])
def test_varlen(mask, head_dims):
    """A packed batch (flash_attention_varlen's layout): sequences of unequal lengths (one empty, Lq != Lk),
    tokens outside every sequence before the first and after the last (their gradients are 0), GQA."""
    rng = np.random.default_rng(6)
    lengths = [(300, 300), (1, 129), (0, 5), (777, 700), (129, 1), (64, 64)]
    cu_q = np.concatenate([[3], 3 + np.cumsum([a for a, _ in lengths])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in lengths])]).astype(np.int32)
    total_q, total_k = int(cu_q[-1]) + 10, int(cu_k[-1]) + 7
    heads_q, heads_kv = 4, 2
    q = jnp.asarray(rng.standard_normal((total_q, heads_q, head_dims[0])), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((total_k, heads_kv, head_dims[0])), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((total_k, heads_kv, head_dims[1])), jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal((total_q, heads_q, head_dims[1])), jnp.bfloat16)
    causal, window = mask == "causal", {"window": (90, 20)}.get(mask)
    scale = head_dims[0] ** -0.5
    out, lse = naive_varlen_f64(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale, window=window)
    delta = np.einsum("thd,thd->ht", np.asarray(dout, np.float64), out)
    max_q, max_k = max(a for a, _ in lengths), max(b for _, b in lengths)
    dq, dk, dv = bwd_call(
        q, k, v, dout, jnp.asarray(lse, jnp.float32), jnp.asarray(delta, jnp.float32), causal=causal,
        softmax_scale=scale, window=window or (-1, -1), varlen=(cu_q, cu_k, max_q, max_k),
    )  # fmt: skip
    want = [np.zeros(x.shape) for x in (q, k, v)]
    for s in range(len(lengths)):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if rows.start == rows.stop:
            continue
        grads = naive_attention_grads_f64(
            *(x[None, part] for x, part in ((q, rows), (k, keys), (v, keys), (dout, rows))),
            causal=causal, softmax_scale=scale, window=window,
        )  # fmt: skip
        want[0][rows], want[1][keys], want[2][keys] = (g[0] for g in grads)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all(), f"{name}: NaN or inf (an element left unwritten?)"
        assert relative_l2(got, ref) < TOLERANCE, name
        outside = slice(0, 3) if name == "dq" else slice(int(cu_k[-1]), None)
        np.testing.assert_array_equal(got[outside], 0.0, err_msg=f"{name} of tokens outside every sequence")
    np.testing.assert_array_equal(np.asarray(dq, np.float64)[int(cu_q[-1]) :], 0.0)


def test_bitwise_reruns():
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, batch=2, seq_q=700, seq_k=900, heads_q=8, heads_kv=2, head_dim=128)
    dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    lse, delta = residuals(q, k, v, dout, causal=True, scale=128**-0.5)

    def fn(*a):
        return bwd_call(*a, causal=True, softmax_scale=128**-0.5)

    assert_bitwise_reruns(fn, (q, k, v, dout, lse, delta), reruns=100)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "none"])
def test_large(causal):
    """2 x 4096 x 16 heads, hd128: against the float64 gradients of two heads (the oracle is slow)."""
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, batch=2, seq_q=4096, heads_q=16, head_dim=128)
    dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    scale = 128**-0.5
    heads = slice(5, 7)
    qs, ks, vs, ds = (x[:, :, heads] for x in (q, k, v, dout))
    lse_s, delta_s = residuals(qs, ks, vs, ds, causal=causal, scale=scale)
    lse = jnp.zeros((2, 16, 4096), jnp.float32).at[:, heads].set(lse_s)
    delta = jnp.zeros((2, 16, 4096), jnp.float32).at[:, heads].set(delta_s)
    dq, dk, dv = bwd_call(q, k, v, dout, lse, delta, causal=causal, softmax_scale=scale)
    want = naive_attention_grads_f64(qs, ks, vs, ds, causal=causal, softmax_scale=scale)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all(), name
        assert relative_l2(got[:, :, heads], ref) < TOLERANCE, name


@pytest.mark.parametrize("head_dims", [(128, 128), (192, 128)], ids=["128", "192x128"])
def test_public_path_grad(head_dims):
    """jax.grad of jzyfa.flash_attention lowers to this target (the plan's backward rows)."""
    import jzyfa

    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, seq_q=300, seq_k=400, heads_q=4, heads_kv=2, head_dim=head_dims[0],
                         head_dim_v=head_dims[1])  # fmt: skip
    dout = rng.standard_normal(q.shape[:-1] + v.shape[-1:])

    def loss(q, k, v):
        out = jzyfa.flash_attention(q, k, v, causal=True)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    hlo = grad.lower(q, k, v).compile().as_text()
    assert "jzyfa_attention_bwd" in hlo
    got = grad(q, k, v)
    want = naive_attention_grads_f64(q, k, v, dout, causal=True, softmax_scale=head_dims[0] ** -0.5)
    for name, g, ref in zip(("dq", "dk", "dv"), got, want):
        assert relative_l2(np.asarray(g, np.float64), ref) < TOLERANCE, name


# Window sides: unbounded, small (most blocks edge blocks) or wide (blocks inside the window).
_side = st.one_of(st.just(-1), st.integers(0, 16), st.integers(0, 400))


@settings(
    max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
@given(
    seq_q=st.integers(1, 600),
    seq_k=st.integers(1, 600),
    kv_heads=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2, 3, 8]),
    head_dims=st.sampled_from([(64, 64), (128, 128), (192, 128)]),
    dtype=st.sampled_from([jnp.bfloat16, jnp.float16]),
    mask=st.one_of(
        st.just(("none", None)),
        st.just(("causal", None)),
        st.tuples(st.just("window"), st.tuples(_side, _side)),
    ),
    batch=st.integers(1, 2),
)
def test_property_shapes_ratios_masks(seq_q, seq_k, kv_heads, ratio, head_dims, dtype, mask, batch):
    """Random lengths (Sq != Sk both ways), GQA ratios, head dims, dtypes and masks against float64."""
    kind, window = mask
    check(seq_q, seq_k, heads_q=kv_heads * ratio, heads_kv=kv_heads, head_dims=head_dims, dtype=dtype,
          causal=kind == "causal", batch=batch, window=window, seed=seq_q * 1000 + seq_k)  # fmt: skip
