"""How the flash-attention primitive is split over a device mesh under a sharded `jax.jit`.

JAX's partitioner (Shardy, the default) reads a sharding rule: batch and heads are passthrough
factors of q, k, v, out and lse, so sharding them needs no collective; the head dims (q/k's and
v/out's, which may differ) and the key sequence need replication. For GQA, KV heads shard with
their query groups: `partition` splits K/V heads over q's head axes when heads_kv allows, else each
device keeps all KV heads and uses its own.
The query sequence is a passthrough factor too: a sequence-sharded q stays where it is, K/V are
gathered (the rule's replication of the key sequence), and each shard attends with its own causal
offset. That is context parallelism without load
balancing; `jzyfa.context_parallel` has the balanced and ring forms.

After propagation the partitioner calls `partition` with the chosen shardings, which returns the
per-shard computation: the kernel on the local blocks. `infer_sharding_from_operands` serves the
older GSPMD partitioner (`jax_use_shardy_partitioner=False`) with the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
from jax import lax
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzyfa._validation import NO_WINDOW, Window, mask_window
from jzyfa.query_chunks import attend_query_chunk, attend_window_chunk

Axes = tuple[str, ...]
# shard_kernel(q, k, v, *, softmax_scale, causal, kernel_required, window) -> (out, lse) on local blocks.
ShardKernel = Callable[..., tuple[jax.Array, jax.Array]]


# Query heads (hq) and KV heads (h) are separate factors. The exact relation, hq = (h, group) with h
# major, is a compound factor, but then Shardy may split h over a sub-axis (4 devices, 2 KV heads),
# which custom_partitioning cannot hand to `partition` as a NamedSharding. So `partition` ties them
# instead: K/V heads split like q's, or stay whole (see ShardPlan). v's and out's head dim (dv) is a
# factor of its own, since it may differ from q's and k's (MLA: 192 for q/k, 128 for v). Special
# factors are listed in order of first appearance (d in q, sk in k, dv in v).
SHARDING_RULE = SdyShardingRule(
    (
        ArrayMapping("b", "sq", "hq", "d"),
        ArrayMapping("b", "sk", "h", "d"),
        ArrayMapping("b", "sk", "h", "dv"),
    ),
    (ArrayMapping("b", "sq", "hq", "dv"), ArrayMapping("b", "hq", "sq")),
    need_replication_factors=("d", "sk", "dv"),
)


def _axes(entry) -> Axes:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: Axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """The mesh axes that split q's batch, sequence and heads; how K/V heads follow."""

    batch: Axes
    seq_q: Axes
    heads_q: Axes
    # True: K/V heads are split over heads_q's axes too (heads_kv divisible by their size). False:
    # there are more query-head shards than KV heads; each shard holds all KV heads and slices one.
    kv_heads_split: bool

    def q_spec(self) -> P:
        return P(_entry(self.batch), _entry(self.seq_q), _entry(self.heads_q), None)

    def kv_spec(self) -> P:
        return P(_entry(self.batch), None, _entry(self.heads_q) if self.kv_heads_split else None, None)

    def lse_spec(self) -> P:
        return P(_entry(self.batch), _entry(self.heads_q), _entry(self.seq_q))


def plan_for(mesh: jax.sharding.Mesh, q_spec: P, q_shape: tuple[int, ...], heads_kv: int) -> ShardPlan:
    """The plan for q sharded as q_spec; shardings the kernel cannot use are dropped (gathered)."""
    entries = tuple(q_spec) + (None,) * (4 - len(q_spec))
    batch, seq_q, heads_q = (_axes(e) for e in entries[:3])
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    # Uneven splits are padded: harmless for batch rows, wrong for causal offsets and head groups.
    if q_shape[1] % size(seq_q):
        seq_q = ()
    head_shards = size(heads_q)
    if q_shape[2] % head_shards or (heads_kv % head_shards and head_shards % heads_kv):
        heads_q = ()
    return ShardPlan(batch, seq_q, heads_q, kv_heads_split=heads_kv % size(heads_q) == 0)


def local_kv_head(plan: ShardPlan, mesh: jax.sharding.Mesh, heads_kv: int) -> jax.Array:
    """With more query-head shards than KV heads (plan.kv_heads_split False): the KV head this shard uses."""
    shards_per_kv_head = math.prod(mesh.shape[a] for a in plan.heads_q) // heads_kv
    return lax.axis_index(plan.heads_q) // shards_per_kv_head


def per_shard_attention(
    shard_kernel: ShardKernel,
    plan: ShardPlan,
    mesh: jax.sharding.Mesh,
    *,
    seq_q: int,
    heads_kv: int,
    softmax_scale: float,
    causal: bool,
    kernel_required: bool,
    window: Window = NO_WINDOW,
) -> Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """The computation each device runs on its blocks (local q, the K/V heads it needs, all keys)."""

    def attend(q, k, v, causal, window=NO_WINDOW):
        return shard_kernel(
            q,
            k,
            v,
            softmax_scale=softmax_scale,
            causal=causal,
            kernel_required=kernel_required,
            window=window,
        )

    def run(q, k, v):
        if not plan.kv_heads_split:
            kv_head = local_kv_head(plan, mesh, heads_kv)
            k, v = (lax.dynamic_slice_in_dim(x, kv_head, 1, axis=2) for x in (k, v))
        if window != NO_WINDOW:
            if not plan.seq_q:
                return attend(q, k, v, causal, window)
            # A sliding window on a sequence shard: the keys the shard's rows reach, and the window
            # shifted to match them (jzyfa.query_chunks.window_key_range), one static branch per shard.
            chunk = q.shape[1]
            shards = math.prod(mesh.shape[a] for a in plan.seq_q)

            def attend_window(q, k, v, local):
                return attend(q, k, v, False, local)

            branches = [
                functools.partial(
                    attend_window_chunk,
                    attend_window,
                    chunk_start=s * chunk,
                    seq_q=seq_q,
                    window=mask_window(causal, window),
                )
                for s in range(shards)
            ]
            return lax.switch(lax.axis_index(plan.seq_q), branches, q, k, v)
        if not (causal and plan.seq_q):
            return attend(q, k, v, causal)
        # A sequence shard's causal offset depends on which shard it is: one static branch each.
        chunk = q.shape[1]
        shards = math.prod(mesh.shape[a] for a in plan.seq_q)
        branches = [
            functools.partial(attend_query_chunk, attend, chunk_start=s * chunk, seq_q=seq_q, causal=True)
            for s in range(shards)
        ]
        return lax.switch(lax.axis_index(plan.seq_q), branches, q, k, v)

    return run


def _plan_from_shapes(mesh, arg_shapes) -> ShardPlan:
    q, k, _ = arg_shapes
    if not isinstance(q.sharding, NamedSharding):
        raise NotImplementedError(
            "jzyfa.flash_attention under a sharded jit needs a mesh: shard its inputs with "
            f"jax.sharding.NamedSharding (got {type(q.sharding).__name__})"
        )
    return plan_for(mesh, q.sharding.spec, q.shape, k.shape[2])


def _result_shardings(mesh, plan: ShardPlan):
    return NamedSharding(mesh, plan.q_spec()), NamedSharding(mesh, plan.lse_spec())


def _infer_sharding_from_operands(
    softmax_scale, causal, kernel_required, window, mesh, arg_shapes, result_shape
):
    del softmax_scale, causal, kernel_required, window, result_shape
    return _result_shardings(mesh, _plan_from_shapes(mesh, arg_shapes))


def partition(
    shard_kernel: ShardKernel, softmax_scale, causal, kernel_required, window, mesh, arg_shapes, result_shape
):
    """The partitioner's callback: the per-shard computation and the shardings it needs."""
    del result_shape  # Derived from q's sharding, which the rule ties it to.
    plan = _plan_from_shapes(mesh, arg_shapes)
    q, k, _ = arg_shapes
    run = per_shard_attention(
        shard_kernel,
        plan,
        mesh,
        seq_q=q.shape[1],
        heads_kv=k.shape[2],
        softmax_scale=softmax_scale,
        causal=causal,
        kernel_required=kernel_required,
        window=window,
    )
    q_sharding, kv_sharding = NamedSharding(mesh, plan.q_spec()), NamedSharding(mesh, plan.kv_spec())
    return mesh, run, _result_shardings(mesh, plan), (q_sharding, kv_sharding, kv_sharding)


def partitioned(shard_kernel: ShardKernel) -> custom_partitioning:
    """shard_kernel wrapped for the partitioner; call it as
    f(q, k, v, softmax_scale, causal, kernel_required, window)."""

    def call(q, k, v, softmax_scale, causal, kernel_required, window):
        return shard_kernel(
            q,
            k,
            v,
            softmax_scale=softmax_scale,
            causal=causal,
            kernel_required=kernel_required,
            window=window,
        )

    fn = custom_partitioning(call, static_argnums=(3, 4, 5, 6))
    fn.def_partition(
        partition=functools.partial(partition, shard_kernel),
        infer_sharding_from_operands=_infer_sharding_from_operands,
        sharding_rule=SHARDING_RULE,
    )
    return fn


# ---- the FP8 kernel: q, k, v and three descales of shape [batch, heads_kv]

# The FP8 call's operands: q, k, v as above, then descale_q, descale_k, descale_v, each [B, Hkv]
# (scalar descales are broadcast to that before the call), sharded with K/V's batch and heads.
FP8_SHARDING_RULE = SdyShardingRule(
    (
        ArrayMapping("b", "sq", "hq", "d"),
        ArrayMapping("b", "sk", "h", "d"),
        ArrayMapping("b", "sk", "h", "dv"),
        ArrayMapping("b", "h"),
        ArrayMapping("b", "h"),
        ArrayMapping("b", "h"),
    ),
    (ArrayMapping("b", "sq", "hq", "dv"), ArrayMapping("b", "hq", "sq")),
    need_replication_factors=("d", "sk", "dv"),
)


def _fp8_plan(mesh, arg_shapes) -> ShardPlan:
    # A sequence-sharded FP8 q is gathered: the chunked causal offsets of the 16-bit path are not
    # wired for FP8 yet (their no-key rows would be e4m3, the kernel's output bf16).
    return dataclasses.replace(_plan_from_shapes(mesh, arg_shapes[:3]), seq_q=())


def _infer_fp8_sharding(
    softmax_scale, causal, window, lean_p, kernel_required, mesh, arg_shapes, result_shape
):
    del softmax_scale, causal, window, lean_p, kernel_required, result_shape
    return _result_shardings(mesh, _fp8_plan(mesh, arg_shapes))


def _partition_fp8(
    shard_kernel, softmax_scale, causal, window, lean_p, kernel_required, mesh, arg_shapes, result_shape
):
    del result_shape
    plan = _fp8_plan(mesh, arg_shapes)
    heads_kv = arg_shapes[1].shape[2]

    def run(q, k, v, *descales):
        if not plan.kv_heads_split:
            kv_head = local_kv_head(plan, mesh, heads_kv)
            k, v = (lax.dynamic_slice_in_dim(x, kv_head, 1, axis=2) for x in (k, v))
            descales = tuple(lax.dynamic_slice_in_dim(d, kv_head, 1, axis=1) for d in descales)
        return shard_kernel(
            q,
            k,
            v,
            *descales,
            softmax_scale=softmax_scale,
            causal=causal,
            window=window,  # q is never sequence-sharded here: the window needs no shift
            lean_p=lean_p,
            kernel_required=kernel_required,
        )

    kv_heads = _entry(plan.heads_q) if plan.kv_heads_split else None
    descale = NamedSharding(mesh, P(_entry(plan.batch), kv_heads))
    kv = NamedSharding(mesh, plan.kv_spec())
    in_shardings = (NamedSharding(mesh, plan.q_spec()), kv, kv, descale, descale, descale)
    return mesh, run, _result_shardings(mesh, plan), in_shardings


def partitioned_fp8(shard_kernel) -> custom_partitioning:
    """The FP8 shard kernel for the partitioner; call it as
    f(q8, k8, v8, descale_q, descale_k, descale_v, softmax_scale, causal, window, lean_p, kernel_required)."""

    def call(q, k, v, dq, dk, dv, softmax_scale, causal, window, lean_p, kernel_required):
        return shard_kernel(
            q,
            k,
            v,
            dq,
            dk,
            dv,
            softmax_scale=softmax_scale,
            causal=causal,
            window=window,
            lean_p=lean_p,
            kernel_required=kernel_required,
        )

    fn = custom_partitioning(call, static_argnums=(6, 7, 8, 9, 10))
    fn.def_partition(
        partition=functools.partial(_partition_fp8, shard_kernel),
        infer_sharding_from_operands=_infer_fp8_sharding,
        sharding_rule=FP8_SHARDING_RULE,
    )
    return fn
