"""Context-parallel prefill: attention with q, k and v split along the sequence over a mesh axis.

Two strategies, both in `jax.shard_map` over the mesh, each shard calling `flash_attention` (the
kernel on Hopper) on its blocks:
- "allgather" (default): K and V are all-gathered along the sequence axis; q stays local. Each of the
  shard's query chunks attends to the key prefix it can see, so the kernel's bottom-right causal
  alignment places it at its offset (`jzyfa.query_chunks`). Communication: one all-gather each of K
  and V, (n-1)/n of their size per device.
- "ring": K/V blocks travel around the ring of shards with `ppermute` (n-1 steps, each issued before
  the step's compute so the two overlap); each shard merges the partial results of its query chunks
  with their log-sum-exps. Causal pairs of chunks that are fully masked are skipped; pairs on the
  diagonal use the causal kernel. Memory per device stays at one K/V block in flight.

The sequence order is `layout` (see `jzyfa.sequence_layout`): with "balanced", shard i holds chunks i
and 2n-1-i of 2n, so causal work is equal across shards.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jzyfa import _validation, sequence_layout
from jzyfa.api import flash_attention
from jzyfa.merge import merge_attention_states
from jzyfa.query_chunks import attend_query_chunk, no_keys_seen

STRATEGIES = ("allgather", "ring")
AxisNames = str | Sequence[str] | None

# How a causal (query chunk, key chunk) pair of equal-sized chunks is computed.
VISIBLE, DIAGONAL, MASKED = 0, 1, 2


def context_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    seq_axis: str,
    causal: bool = True,
    strategy: str = "allgather",
    layout: str = "balanced",
    batch_axis: AxisNames = None,
    head_axis: AxisNames = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`flash_attention` for q, k, v sharded along the sequence over `mesh` axis `seq_axis`.

    NOTE: by default (layout="balanced") q, k, v and the output are in the BALANCED order, not the
    natural one: permute inputs with `jzyfa.to_balanced_layout(x, n)` and outputs back with
    `jzyfa.from_balanced_layout(out, n)`, or pass layout="contiguous" for naturally ordered arrays.
    Naturally ordered inputs with the default give a permuted (wrong) result, with no error.

    Args:
      q: [batch, seq_q, heads_q, head_dim]; k: [batch, seq_k, heads_kv, head_dim]; v: [batch,
        seq_k, heads_kv, head_dim_v] (MLA: head_dim_v may differ); bf16, f16 or float32. Their sequence axes are in `layout` order (for "balanced", as made by
        `jzyfa.to_balanced_layout(x, mesh.shape[seq_axis])`), and so are the outputs'.
      mesh: the device mesh; the function runs as a `jax.shard_map` over all of its axes.
      seq_axis: the mesh axis that splits the sequence (n shards).
      causal: bottom-right aligned mask over the natural order, as in `flash_attention`.
      strategy: "allgather" (gather K/V) or "ring" (pass K/V blocks around, merge with LSEs).
        Causal "ring" needs seq_q == seq_k.
      layout: "balanced" (2n chunks, shard i holds chunks i and 2n-1-i) or "contiguous".
      batch_axis, head_axis: mesh axes (a name or a tuple of names) that also split batch and
        heads, as in a plain sharded jit; heads split by the same count in q and k/v, so their count
        must divide heads_kv.
      softmax_scale, return_lse, implementation: as in `flash_attention`.

    Returns:
      out like q, or (out, lse) with lse float32 [batch, heads_q, seq_q], all in `layout` order.
    """
    _validation.check_qkv(q, k, v)
    _validation.check_causal(causal)
    _validation.check_implementation(implementation)
    softmax_scale = _validation.resolve_softmax_scale(softmax_scale, q.shape[-1])
    if _validation.is_fp8(q.dtype):
        raise TypeError("context_parallel_attention takes bf16, f16 or float32 inputs, not FP8")
    batch_axes, head_axes = _check_mesh_axes(mesh, seq_axis, batch_axis, head_axis)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if layout not in sequence_layout.LAYOUTS:
        raise ValueError(f"layout must be one of {sequence_layout.LAYOUTS}, got {layout!r}")
    _check_shapes(q, k, mesh, seq_axis, batch_axes, head_axes, strategy, layout, causal)

    attend = functools.partial(_attend, softmax_scale=softmax_scale, implementation=implementation)
    per_shard = functools.partial(
        _ring if strategy == "ring" else _allgather,
        attend,
        seq_axis=seq_axis,
        num_shards=mesh.shape[seq_axis],
        layout=layout,
        causal=causal,
    )
    batch, heads = _entry(batch_axes), _entry(head_axes)
    qkv_spec = P(batch, seq_axis, heads, None)
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        # Explicit mesh axes make shardings part of the types; shard_map then wants them to match.
        q, k, v = jax.reshard((q, k, v), jax.sharding.NamedSharding(mesh, qkv_spec))
    out, lse = jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(qkv_spec, qkv_spec, qkv_spec),
        out_specs=(qkv_spec, P(batch, heads, seq_axis)),
    )(q, k, v)
    return (out, lse) if return_lse else out


def _attend(q, k, v, causal, *, softmax_scale, implementation):
    return flash_attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True, implementation=implementation
    )


def _axes(names: AxisNames) -> tuple[str, ...]:
    if names is None:
        return ()
    return (names,) if isinstance(names, str) else tuple(names)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _check_mesh_axes(mesh, seq_axis, batch_axis, head_axis):
    batch_axes, head_axes = _axes(batch_axis), _axes(head_axis)
    named = {"seq_axis": (seq_axis,), "batch_axis": batch_axes, "head_axis": head_axes}
    for arg, axes in named.items():
        for axis in axes:
            if axis not in mesh.axis_names:
                raise ValueError(f"{arg} {axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    used = (seq_axis,) + batch_axes + head_axes
    if len(set(used)) != len(used):
        raise ValueError(f"seq_axis, batch_axis and head_axis must name different mesh axes, got {used}")
    return batch_axes, head_axes


def _check_shapes(q, k, mesh, seq_axis, batch_axes, head_axes, strategy, layout, causal):
    shards = mesh.shape[seq_axis]
    pieces = shards * sequence_layout.chunks_per_shard(layout)
    for name, x in (("q", q), ("k", k)):
        if x.shape[1] % pieces:
            raise ValueError(
                f"{name}'s sequence length {x.shape[1]} must be a multiple of {pieces} "
                f"({shards} shards of {seq_axis!r}, layout {layout!r})"
            )
    if strategy == "ring" and causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"the causal ring needs seq_q == seq_k, got {q.shape[1]} and {k.shape[1]}; use strategy='allgather'"
        )
    batch_shards = math.prod(mesh.shape[a] for a in batch_axes)
    if q.shape[0] % batch_shards:
        raise ValueError(f"batch {q.shape[0]} is not divisible by the {batch_shards} shards of {batch_axes}")
    head_shards = math.prod(mesh.shape[a] for a in head_axes)
    if k.shape[2] % head_shards:
        raise ValueError(
            f"heads_kv {k.shape[2]} is not divisible by the {head_shards} shards of {head_axes}; "
            "KV heads split with their query groups"
        )


def _concat(parts):
    """[(out, lse)] of consecutive query chunks -> (out, lse) of all of them."""
    outs, lses = zip(*parts)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)


def _allgather(attend, q, k, v, *, seq_axis, num_shards, layout, causal):
    k_all, v_all = (lax.all_gather(x, seq_axis, axis=1, tiled=True) for x in (k, v))
    if not causal:
        return attend(q, k_all, v_all, False)  # Without a mask the order of keys does not matter.
    if layout == "balanced":
        k_all, v_all = (sequence_layout.from_balanced_layout(x, num_shards) for x in (k_all, v_all))
    slots = sequence_layout.chunks_per_shard(layout)
    chunk = q.shape[1] // slots
    seq_q = chunk * slots * num_shards

    def shard_branch(shard):  # The shard's chunk offsets are static inside its branch.
        def run(q, k_all, v_all):
            q_chunks = jnp.split(q, slots, axis=1)
            chunk_ids = sequence_layout.shard_chunks(shard, num_shards, layout)
            return _concat(
                [
                    attend_query_chunk(
                        attend, qc, k_all, v_all, chunk_start=c * chunk, seq_q=seq_q, causal=True
                    )
                    for qc, c in zip(q_chunks, chunk_ids)
                ]
            )

        return run

    branches = [shard_branch(s) for s in range(num_shards)]
    return lax.switch(lax.axis_index(seq_axis), branches, q, k_all, v_all)


def _attend_block(attend, case, q, k, v):
    """One (query chunk, key chunk) pair; `case` is static (an int) or chosen at run time."""
    branches = (
        lambda q, k, v: attend(q, k, v, False),
        lambda q, k, v: attend(q, k, v, True),
        lambda q, k, v: no_keys_seen(q, v),
    )
    if isinstance(case, int):
        return branches[case](q, k, v)
    return lax.switch(case, branches, q, k, v)


def _ring(attend, q, k, v, *, seq_axis, num_shards, layout, causal):
    # Non-causal: every key is visible, so the whole local q meets each block in one call.
    slots = sequence_layout.chunks_per_shard(layout) if causal else 1
    shard = lax.axis_index(seq_axis)
    q_chunks = jnp.split(q, slots, axis=1)
    merged = [None] * slots  # per query chunk: (out float32, lse) over the key blocks seen so far
    kv = (k, v)
    to_next = [(i, (i + 1) % num_shards) for i in range(num_shards)]
    for step in range(num_shards):
        # Sent before this step's compute, so the transfer overlaps it.
        incoming = lax.ppermute(kv, seq_axis, to_next) if step < num_shards - 1 else None
        source = (shard - step) % num_shards  # whose K/V block this shard holds now
        k_chunks, v_chunks = (jnp.split(x, slots, axis=1) for x in kv)
        for a, b, case in _block_pairs(step, shard, source, num_shards, layout, causal):
            out, lse = _attend_block(attend, case, q_chunks[a], k_chunks[b], v_chunks[b])
            part = (out.astype(jnp.float32), lse)
            merged[a] = part if merged[a] is None else merge_attention_states(*merged[a], *part)
        kv = incoming
    out, lse = _concat(merged)
    return out.astype(q.dtype), lse


def _block_pairs(step, shard, source, num_shards, layout, causal):
    """(query chunk slot, key chunk slot, case) for the pairs that may hold visible keys."""
    if not causal:
        return [(0, 0, VISIBLE)]
    my_chunks = sequence_layout.shard_chunks(shard, num_shards, layout)
    their_chunks = sequence_layout.shard_chunks(source, num_shards, layout)
    slots = range(len(my_chunks))
    pairs = [(a, b, _pair_case(step, a, b, my_chunks[a], their_chunks[b])) for a in slots for b in slots]
    # Pairs known at trace time to be fully masked cost nothing; others decide at run time.
    return [(a, b, case) for a, b, case in pairs if not (isinstance(case, int) and case == MASKED)]


def _pair_case(step, a, b, q_chunk, k_chunk):
    """VISIBLE, DIAGONAL or MASKED for causal query chunk q_chunk against key chunk k_chunk."""
    if step == 0:
        # A shard's own block: its chunks are in ascending order, so the case is the same everywhere.
        return DIAGONAL if a == b else VISIBLE if b < a else MASKED
    return jnp.where(k_chunk < q_chunk, VISIBLE, jnp.where(k_chunk == q_chunk, DIAGONAL, MASKED))
