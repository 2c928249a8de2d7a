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
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "the kernel left outputs unwritten (NaN poison)"
    batch, heads_q, heads_kv = q.shape[0], q.shape[2], k.shape[2]
    group = heads_q // heads_kv
    for b in range(batch):
        for h in range(heads_kv):
            qs = slice(h * group, (h + 1) * group)
            part_out, part_lse = run(q[b : b + 1, :, qs], k[b : b + 1, :, h : h + 1], v[b : b + 1, :, h : h + 1])
            np.testing.assert_array_equal(out[b : b + 1, :, qs].view(np.uint32), part_out.view(np.uint32))
            np.testing.assert_array_equal(lse[b : b + 1, qs].view(np.uint32), part_lse.view(np.uint32))
