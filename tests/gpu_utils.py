"""Skipping GPU tests cleanly where there is no Hopper GPU with the jzyfa extension.

Use either `@requires_hopper` on a test or class, or `pytestmark = pytest.mark.gpu` in a module
(conftest skips `gpu`-marked tests with the same reason).
"""

import pytest

import jzyfa

# None where the kernel can run; else why not (no GPU, not Hopper, extension missing).
HOPPER_SKIP_REASON: str | None = jzyfa.kernel_unavailable_reason()

requires_hopper = pytest.mark.skipif(
    HOPPER_SKIP_REASON is not None, reason=f"needs a Hopper GPU and the jzyfa extension: {HOPPER_SKIP_REASON}"
)


def assert_bitwise_reruns(fn, args, reruns: int) -> None:
    """fn(*args) gives bitwise the same results `reruns` times, with other GPU work (a matmul chain)
    queued between the calls: the kernels' outputs must not depend on scheduling."""
    import jax.numpy as jnp
    import numpy as np

    first = [np.asarray(x).view(np.uint8) for x in fn(*args)]
    noise = jnp.ones((4096, 4096))
    for _ in range(reruns):
        again = fn(*args)
        noise = noise @ noise * 1e-4  # other GPU work in between
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, np.asarray(b).view(np.uint8))


def tile_groups(*, batch: int, seq_q: int, seq_k: int, heads_q: int, causal: bool, block_m: int = 128) -> int:
    """How many groups of (batch, head) pairs the dense kernels' tile order has for such a call on this
    GPU (the extension's TileGroupPairs, ffi/launch_utils.h)."""
    import importlib

    import jax

    from jzyfa import _extension

    module = importlib.import_module(_extension.EXTENSION_MODULE)
    sm_count = jax.devices()[0].core_count
    pairs = batch * heads_q
    group = module.tile_group_pairs(
        pairs=pairs, seqlen_q=seq_q, seqlen_k=seq_k, causal=causal, window_left=-1, window_right=-1,
        block_m=block_m, sm_count=sm_count,
    )  # fmt: skip
    return pairs // group


def assert_equals_per_head_calls(run, q, k, v) -> None:
    """run(q, k, v) -> (out, lse) as NumPy arrays ([b, sq, hq, d], [b, hq, sq]), NaN-poisoned beforehand:
    the whole call equals, bit for bit, one call per (batch element, KV head) with that head's query
    group. Each tile's result does not depend on where the tile order puts it, so this checks that the
    order covers every tile of every (batch, head) pair once."""
    import numpy as np

    out, lse = run(q, k, v)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), (
        "the kernel left outputs unwritten (NaN poison)"
    )
    batch, heads_q, heads_kv = q.shape[0], q.shape[2], k.shape[2]
    group = heads_q // heads_kv
    for b in range(batch):
        for h in range(heads_kv):
            qs = slice(h * group, (h + 1) * group)
            part_out, part_lse = run(
                q[b : b + 1, :, qs], k[b : b + 1, :, h : h + 1], v[b : b + 1, :, h : h + 1]
            )
            np.testing.assert_array_equal(out[b : b + 1, :, qs].view(np.uint32), part_out.view(np.uint32))
            np.testing.assert_array_equal(lse[b : b + 1, qs].view(np.uint32), part_lse.view(np.uint32))


def ffi_attention(
    q,
    k,
    v,
    *,
    cu_seqlens=None,
    max_seqlens=(0, 0),
    descales=None,
    int8_scales=None,
    out_head_dim=None,
    softmax_scale=0.1,
    causal=False,
    window=(-1, -1),
    lean_p=True,
    v_transposed=False,
    key_block=0,
    softcap=0.0,
):
    """The FFI handler `jzyfa_attention_fwd` itself, no dispatch in between: (out, lse, tile counter).

    Its contract (docs/architecture.md, jzyfa.primitives): operands q, k, v, then cu_seqlens_q and
    cu_seqlens_k (varlen: `cu_seqlens` a pair of int32 [num_seqs + 1]), then descale_q, descale_k,
    descale_v (FP8 q: passed flattened to 1-D), or for int8 q `int8_scales`, (q_scale, k_scale, descale_v)
    passed as they are; results out (q's dtype, bf16 for e4m3 and int8; v's head dim, or
    out_head_dim), lse float32 ([B, Hq, Sq] dense, [Hq, Tq] varlen) and one int32 tile counter; every
    attribute present with its type. With v_transposed, v is V^T (dense [B, Hkv, Dv, keys], varlen
    [Hkv, Dv, keys]), so its head dim is v.shape[-2]."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jzyfa import primitives

    varlen = cu_seqlens is not None
    eight_bit = jnp.dtype(q.dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int8))
    dv = out_head_dim or (v.shape[-2] if v_transposed else v.shape[-1])
    if varlen:
        total_q, heads_q = q.shape[:2]
        out_shape, lse_shape = (total_q, heads_q, dv), (heads_q, total_q)
    else:
        batch, seq_q, heads_q = q.shape[:3]
        out_shape, lse_shape = (batch, seq_q, heads_q, dv), (batch, heads_q, seq_q)
    results = (
        jax.ShapeDtypeStruct(out_shape, jnp.bfloat16 if eight_bit else q.dtype),
        jax.ShapeDtypeStruct(lse_shape, jnp.float32),
        jax.ShapeDtypeStruct(primitives.TILE_COUNTER.shape, primitives.TILE_COUNTER.dtype),
    )
    extras = [jnp.asarray(cu, jnp.int32) for cu in cu_seqlens] if varlen else []
    if descales is not None:
        extras += [jnp.asarray(d, jnp.float32).reshape(-1) for d in descales]
    if int8_scales is not None:
        extras += [jnp.asarray(d, jnp.float32) for d in int8_scales]
    attributes = {
        "softmax_scale": np.float32(softmax_scale),
        "causal": bool(causal),
        "window_left": np.int64(window[0]),
        "window_right": np.int64(window[1]),
        "varlen": varlen,
        "max_seqlen_q": np.int64(max_seqlens[0]),
        "max_seqlen_k": np.int64(max_seqlens[1]),
        "lean_p": bool(lean_p),
        "v_transposed": bool(v_transposed),
        "key_block": np.int64(key_block),
        "softcap": np.float32(softcap),
    }
    # The same attribute names and types as the primitive's lowering passes.
    spec = primitives.make_spec(softmax_scale=softmax_scale, causal=causal)
    want = primitives.ffi_attributes(spec)
    assert {name: type(value) for name, value in attributes.items()} == {
        name: type(value) for name, value in want.items()
    }, (attributes, want)
    return jax.ffi.ffi_call(primitives.FFI_TARGET, results)(q, k, v, *extras, **attributes)


def kernel_call(hlo_text: str) -> str:
    """The one `jzyfa_attention_fwd` custom call of an HLO text (lowered or compiled): its line."""
    from jzyfa import primitives

    calls = [
        line for line in hlo_text.splitlines() if f'custom_call_target="{primitives.FFI_TARGET}"' in line
    ]
    assert len(calls) == 1, f"expected one {primitives.FFI_TARGET} custom call, got {len(calls)}:\n{hlo_text}"
    return calls[0]


def has_custom_call(hlo_text: str, target: str) -> bool:
    """Whether the HLO text holds a custom call to `target` (by custom_call_target, not by name)."""
    return f'custom_call_target="{target}"' in hlo_text
