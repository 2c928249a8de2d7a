"""How the attention primitive is split over a device mesh under a sharded `jax.jit`.

One partitioner for every configuration; its Shardy rule is built from the operand list (`rule_for`):
q, k, v, then cu_seqlens_q/k for packed batches, then the FP8 descales or INT8 scales. Batch and heads are passthrough
factors of every operand and result, so sharding them needs no collective; head dims, the key sequence,
packed token axes and the offsets need replication. For GQA, KV heads shard with their query groups:
`partition` splits K/V heads over q's head axes when heads_kv allows, else each device keeps all KV heads
and uses its own. The query sequence of a dense 16-bit call is a passthrough factor too: a
sequence-sharded q stays where it is, K/V are gathered (the rule's replication of the key sequence), and
each shard attends with its own causal offset or window (context parallelism without load balancing;
`jzyfa.context_parallel` has the balanced and ring forms). FP8, INT8 and packed calls gather a sharded
q sequence instead.

After propagation the partitioner calls `partition` with the chosen shardings, which returns the
per-shard computation: the kernel on the local blocks. `infer_sharding_from_operands` serves the older
GSPMD partitioner (`jax_use_shardy_partitioner=False`) with the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzyfa._validation import NO_WINDOW, mask_window
from jzyfa.query_chunks import attend_query_chunk, attend_window_chunk, window_key_range

Axes = tuple[str, ...]
# shard_kernel(q, k, v, *extras, spec) -> (out, lse) on local blocks (jzyfa.primitives.attention_shard), or
# the backward's shard_kernel(q, k, v, dout, lse, delta, *extras, spec) -> (dq, dk, dv)
# (jzyfa.primitives.attention_bwd_shard).
ShardKernel = Callable[..., tuple[jax.Array, ...]]


def rule_for(spec, direction: str = "fwd") -> SdyShardingRule:
    """The Shardy rule of a call with this AttentionSpec's operands, forward or backward.

    Query heads (hq) and KV heads (h) are separate factors. The exact relation, hq = (h, group) with h
    major, is a compound factor, but then Shardy may split h over a sub-axis (4 devices, 2 KV heads),
    which custom_partitioning cannot hand to `partition` as a NamedSharding; so `partition` ties them
    instead. v's and out's head dim (dv) is a factor of its own (MLA: 192 for q/k, 128 for v). The
    backward's operands are q, k, v, dout (out's mapping), lse and delta (lse's); its results dq, dk, dv
    map as q, k, v.
    """
    if spec.varlen:
        q, k, v = ArrayMapping("tq", "hq", "d"), ArrayMapping("tk", "h", "d"), ArrayMapping("tk", "h", "dv")
        out, lse = ArrayMapping("tq", "hq", "dv"), ArrayMapping("hq", "tq")
        offsets = [ArrayMapping("n1"), ArrayMapping("n1")]
        descale = ArrayMapping("n", "h")
        replicated = ("d", "tk", "dv", "n1", "tq")
    else:
        q, k, v = (
            ArrayMapping("b", "sq", "hq", "d"),
            ArrayMapping("b", "sk", "h", "d"),
            ArrayMapping("b", "sk", "h", "dv"),
        )
        out, lse = ArrayMapping("b", "sq", "hq", "dv"), ArrayMapping("b", "hq", "sq")
        offsets = [ArrayMapping("b"), ArrayMapping("b")] if spec.seqlens else []  # seqlens_q, seqlens_k
        descale = ArrayMapping("b", "h")
        replicated = ("d", "sk", "dv")
    if direction == "fwd":
        operands, results = [q, k, v, *offsets], (out, lse)
    else:
        operands, results = [q, k, v, out, lse, lse, *offsets], (q, k, v)
    if spec.fp8:
        operands += [descale] * 3
        if spec.varlen:
            replicated += ("n",)
    if spec.int8:  # q_scale [b, hq, q blocks], k_scale [b, h, key blocks], descale_v [b, h] (varlen: n for b)
        rows = "n" if spec.varlen else "b"
        operands += [ArrayMapping(rows, "hq", "qb"), ArrayMapping(rows, "h", "kb"), descale]
        replicated += ("qb", "kb") + (("n",) if spec.varlen else ())
    # Special factors are listed in order of first appearance.
    order = [f for mapping in operands for f in mapping if f in replicated]
    replicated = tuple(dict.fromkeys(order))
    return SdyShardingRule(tuple(operands), results, need_replication_factors=replicated)


def _axes(entry) -> Axes:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: Axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """The mesh axes that split q's batch, sequence and heads; how K/V heads follow."""

    varlen: bool
    batch: Axes
    seq_q: Axes
    heads_q: Axes
    # True: K/V heads are split over heads_q's axes too (heads_kv divisible by their size). False:
    # there are more query-head shards than KV heads; each shard holds all KV heads and slices one.
    kv_heads_split: bool

    @property
    def kv_heads(self):
        return _entry(self.heads_q) if self.kv_heads_split else None

    def q_spec(self) -> P:
        if self.varlen:
            return P(None, _entry(self.heads_q), None)
        return P(_entry(self.batch), _entry(self.seq_q), _entry(self.heads_q), None)

    def kv_spec(self) -> P:
        if self.varlen:
            return P(None, self.kv_heads, None)
        return P(_entry(self.batch), None, self.kv_heads, None)

    def descale_spec(self) -> P:
        return P(None if self.varlen else _entry(self.batch), self.kv_heads)

    def lse_spec(self) -> P:
        if self.varlen:
            return P(_entry(self.heads_q), None)
        return P(_entry(self.batch), _entry(self.heads_q), _entry(self.seq_q))

    def kv_head_axis(self) -> int:
        return 1 if self.varlen else 2


def plan_for(mesh: jax.sharding.Mesh, q_spec: P, q_shape: tuple[int, ...], heads_kv: int, spec) -> ShardPlan:
    """The plan for q sharded as q_spec; shardings the kernel cannot use are dropped (gathered)."""
    rank = len(q_shape)
    entries = tuple(q_spec) + (None,) * (rank - len(q_spec))
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    if spec.varlen:
        batch, seq_q, heads_q = (), (), _axes(entries[1])
        heads = q_shape[1]
    else:
        batch, seq_q, heads_q = (_axes(e) for e in entries[:3])
        heads = q_shape[2]
        # Uneven splits are padded: harmless for batch rows, wrong for causal offsets and head groups.
        # FP8 calls gather a sharded q sequence (their chunks' no-key rows are not wired for e4m3), and so
        # do padded ones (each sequence's length holds for its whole row).
        if spec.eight_bit or spec.seqlens or q_shape[1] % size(seq_q):
            seq_q = ()
    head_shards = size(heads_q)
    if heads % head_shards or (heads_kv % head_shards and head_shards % heads_kv):
        heads_q = ()
    return ShardPlan(
        spec.varlen is not None, batch, seq_q, heads_q, kv_heads_split=heads_kv % size(heads_q) == 0
    )


def local_kv_head(plan: ShardPlan, mesh: jax.sharding.Mesh, heads_kv: int) -> jax.Array:
    """With more query-head shards than KV heads (plan.kv_heads_split False): the KV head this shard uses."""
    shards_per_kv_head = math.prod(mesh.shape[a] for a in plan.heads_q) // heads_kv
    return lax.axis_index(plan.heads_q) // shards_per_kv_head


def per_shard_attention(shard_kernel: ShardKernel, plan: ShardPlan, mesh, *, seq_q: int, heads_kv: int, spec):
    """The computation each device runs on its blocks (local q, the K/V heads it needs, all keys)."""

    def run(q, k, v, *extras):
        if not plan.kv_heads_split:
            kv_head = local_kv_head(plan, mesh, heads_kv)
            axis = plan.kv_head_axis()
            k, v = (lax.dynamic_slice_in_dim(x, kv_head, 1, axis=axis) for x in (k, v))
            if spec.fp8 or spec.int8:  # the KV-head scales (INT8's q_scale follows q's heads)
                n = len(extras) - (2 if spec.int8 else 3)
                extras = (*extras[:n], *(lax.dynamic_slice_in_dim(d, kv_head, 1, axis=1) for d in extras[n:]))

        def attend(q, k, v, causal, window=NO_WINDOW):
            local = dataclasses.replace(spec, causal=causal, window=window)
            return shard_kernel(q, k, v, *extras, spec=local)

        if not plan.seq_q or not (spec.causal or spec.window != NO_WINDOW):
            return attend(q, k, v, spec.causal, spec.window)
        # A sequence shard's mask depends on which shard it is: one static branch each, reading only the
        # keys the shard's rows reach (jzyfa.query_chunks).
        chunk = q.shape[1]
        shards = math.prod(mesh.shape[a] for a in plan.seq_q)
        if spec.window != NO_WINDOW:
            branches = [
                functools.partial(
                    attend_window_chunk,
                    lambda q, k, v, local: attend(q, k, v, False, local),
                    chunk_start=s * chunk,
                    seq_q=seq_q,
                    window=mask_window(spec.causal, spec.window),
                )
                for s in range(shards)
            ]
        else:
            branches = [
                functools.partial(attend_query_chunk, attend, chunk_start=s * chunk, seq_q=seq_q, causal=True)
                for s in range(shards)
            ]
        return lax.switch(lax.axis_index(plan.seq_q), branches, q, k, v)

    return run


def per_shard_attention_bwd(
    shard_kernel: ShardKernel, plan: ShardPlan, mesh, *, seq_q: int, heads_kv: int, spec
):
    """The backward each device runs on its blocks: dq of its rows; dk and dv summed over the devices
    that share them. Sequence shards see different key ranges (their own causal offset or window) and
    add their dk, dv over the sequence axes; with more query-head shards than KV heads, the shards of one
    KV head add theirs over the head axes. Sums run in float32 (one collective each)."""
    window = mask_window(spec.causal, spec.window)

    def backward(q, k, v, dout, lse, delta, *extras, window):
        causal = window == (-1, 0)
        local = dataclasses.replace(spec, causal=causal, window=NO_WINDOW if causal else window)
        return shard_kernel(q, k, v, dout, lse, delta, *extras, spec=local)

    def sequence_shard(shard: int, chunk: int, extras):
        """The branch of sequence shard `shard`: only the keys its rows reach, padded back to all keys."""

        def grads(q, k, v, dout, lse, delta):
            seq_k = k.shape[1]
            begin, end, local = window_key_range(shard * chunk, chunk, seq_q, seq_k, window)
            if end <= begin:  # its rows see no key
                return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
            keys = slice(begin, end)
            dq, dk, dv = backward(q, k[:, keys], v[:, keys], dout, lse, delta, *extras, window=local)
            widths = ((0, 0), (begin, seq_k - end), (0, 0), (0, 0))
            return dq, jnp.pad(dk, widths), jnp.pad(dv, widths)

        return grads

    def run(q, k, v, dout, lse, delta, *extras):
        summed_over = ()
        if not plan.kv_heads_split:
            kv_head = local_kv_head(plan, mesh, heads_kv)
            axis = plan.kv_head_axis()
            k, v = (lax.dynamic_slice_in_dim(x, kv_head, 1, axis=axis) for x in (k, v))
            summed_over += plan.heads_q
        if not plan.seq_q or window == NO_WINDOW:
            dq, dk, dv = shard_kernel(q, k, v, dout, lse, delta, *extras, spec=spec)
        else:
            branches = [
                sequence_shard(s, q.shape[1], extras)
                for s in range(math.prod(mesh.shape[a] for a in plan.seq_q))
            ]
            dq, dk, dv = lax.switch(lax.axis_index(plan.seq_q), branches, q, k, v, dout, lse, delta)
            summed_over = plan.seq_q + summed_over
        if not summed_over:
            return dq, dk, dv
        if not plan.kv_heads_split:  # this shard's KV head in place among all of them, zeros elsewhere
            place = lambda g: lax.dynamic_update_slice_in_dim(
                jnp.zeros(g.shape[:axis] + (heads_kv,) + g.shape[axis + 1 :], jnp.float32),
                g.astype(jnp.float32),
                kv_head,
                axis,
            )
        else:
            place = lambda g: g.astype(jnp.float32)
        dk_sum, dv_sum = lax.psum((place(dk), place(dv)), summed_over)
        return dq, dk_sum.astype(dk.dtype), dv_sum.astype(dv.dtype)

    return run


def _plan_from_shapes(mesh, arg_shapes, spec) -> ShardPlan:
    q, k = arg_shapes[:2]
    if not isinstance(q.sharding, NamedSharding):
        raise NotImplementedError(
            "jzyfa attention under a sharded jit needs a mesh: shard its inputs with "
            f"jax.sharding.NamedSharding (got {type(q.sharding).__name__})"
        )
    heads_kv = k.shape[1] if spec.varlen else k.shape[2]
    return plan_for(mesh, q.sharding.spec, q.shape, heads_kv, spec)


def _shardings(mesh, plan: ShardPlan, spec, direction: str):
    """(result shardings, operand shardings) of the per-shard call."""
    named = lambda p: NamedSharding(mesh, p)
    q, kv, lse = named(plan.q_spec()), named(plan.kv_spec()), named(plan.lse_spec())
    if direction == "fwd":
        results, operands = (q, lse), [q, kv, kv]
    else:  # dout has q's sharding (its head dim is replicated like q's), delta lse's
        results, operands = (q, kv, kv), [q, kv, kv, q, lse, lse]
    if spec.varlen:
        operands += [named(P(None))] * 2
    if spec.seqlens:
        operands += [named(P(_entry(plan.batch)))] * 2
    if spec.fp8:
        operands += [named(plan.descale_spec())] * 3
    if spec.int8:
        operands += [
            named(P(_entry(plan.batch), _entry(plan.heads_q), None)),
            named(P(_entry(plan.batch), plan.kv_heads, None)),
            named(plan.descale_spec()),
        ]
    return results, tuple(operands)


def _infer_sharding_from_operands(direction, spec, mesh, arg_shapes, result_shape):
    del result_shape
    return _shardings(mesh, _plan_from_shapes(mesh, arg_shapes, spec), spec, direction)[0]


def without_context_mesh(run: Callable) -> Callable:
    """`run` traced with no context mesh. The partitioner traces the per-shard computation while the
    caller's `jax.set_mesh` is still in effect; under a mesh of Explicit axes the local ops would then
    carry that mesh's shardings into a module that is compiled for one device, which XLA refuses
    ("No registered implementation for untyped custom call to Sharding")."""

    @functools.wraps(run)
    def local(*args):
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return run(*args)

    return local


_PER_SHARD = {"fwd": per_shard_attention, "bwd": per_shard_attention_bwd}


def partition(shard_kernel: ShardKernel, direction: str, spec, mesh, arg_shapes, result_shape):
    """The partitioner's callback: the per-shard computation and the shardings it needs."""
    del result_shape  # Derived from q's sharding, which the rule ties it to.
    plan = _plan_from_shapes(mesh, arg_shapes, spec)
    q, k = arg_shapes[:2]
    heads_kv = k.shape[1] if spec.varlen else k.shape[2]
    run = _PER_SHARD[direction](shard_kernel, plan, mesh, seq_q=q.shape[1], heads_kv=heads_kv, spec=spec)
    results, operands = _shardings(mesh, plan, spec, direction)
    return mesh, without_context_mesh(run), results, operands


def partitioned(shard_kernel: ShardKernel, direction: str = "fwd"):
    """shard_kernel wrapped for the partitioner; call it as f(*operands, spec). One
    custom_partitioning per operand list, since the rule depends on it."""

    @functools.cache
    def wrapped(num_operands: int, varlen: bool, eight_bit: bool):
        def call(*operands):
            *arrays, spec = operands
            return shard_kernel(*arrays, spec=spec)

        fn = custom_partitioning(call, static_argnums=(num_operands,))

        def rule(spec, mesh, operand_types, result_types):
            del mesh, operand_types, result_types
            return rule_for(spec, direction)

        fn.def_partition(
            partition=functools.partial(partition, shard_kernel, direction),
            infer_sharding_from_operands=functools.partial(_infer_sharding_from_operands, direction),
            sharding_rule=rule,
        )
        return fn

    def call(*operands):
        *arrays, spec = operands
        return wrapped(len(arrays), spec.varlen is not None, spec.eight_bit)(*arrays, spec)

    return call
