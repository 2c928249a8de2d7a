"""How evenly the persistent grid's tile orders spread a dense call's work over the CTAs: a model, no GPU.

The dense kernels claim tiles from a counter in a fixed order (PlanTile in ffi/flash_fwd_common.cuh):
each CTA takes the next tile when it finishes one. This replays that list schedule with a tile's cost
= its key blocks + a fixed per-tile cost (in key blocks), and prints the makespan over the ideal (total
work / CTAs) for the order before 2026-12-03 (one batch element per group: heads fastest, then query
tiles longest first, then batch) and today's (groups of TileGroupPairs' size, ffi/launch_utils.h,
mirrored here). L2 and HBM are not in it: it says whether an order loses time at the call's end, not
what its K/V traffic costs.

    python tools/tile_order_model.py                       # the benchmark's shapes, 16 heads
    python tools/tile_order_model.py --heads 32 --sm 132 --tile_cost 2
"""

from __future__ import annotations

import argparse
import heapq
import math
from collections.abc import Iterator, Sequence

BLOCK_M = 128  # query rows per tile
BLOCK_N = 128  # keys per block (head dim 128)
BALANCE = 2  # kTileGroupBalance


def tile_keys(seq_q: int, seq_k: int, causal: bool, block_m: int = BLOCK_M) -> list[int]:
    """Keys each query tile sees, tile t = rows t * block_m..., bottom-right causal alignment."""
    diagonal = seq_k - seq_q
    keys = []
    for t in range(-(-seq_q // block_m)):
        last = min((t + 1) * block_m, seq_q) - 1 + diagonal
        keys.append(max(0, min(seq_k, last + 1)) if causal else seq_k)
    return keys


def group_pairs(pairs: int, keys: Sequence[int], sm_count: int) -> int:
    """TileGroupPairs: the smallest divisor of `pairs` whose key work reaches BALANCE x sm_count longest tiles."""
    work, longest = sum(keys), max(keys, default=0)
    if work == 0:
        return 1
    group = min(max(1, math.ceil(BALANCE * sm_count * longest / work)), pairs)
    while pairs % group:
        group += 1
    return group


def grouped_order(pairs: int, m_tiles: int, group: int) -> Iterator[tuple[int, int]]:
    """(pair, query tile from the top) in claim order: groups of `group` pairs, longest tiles first inside
    a group, the group's pairs fastest (pair = batch * heads + head)."""
    for first in range(0, pairs, group):
        for q_index in range(m_tiles):
            for pair in range(first, first + group):
                yield pair, m_tiles - 1 - q_index


def makespan_ratio(costs: Sequence[float], sm_count: int) -> float:
    """Greedy list schedule of `costs` in order on sm_count CTAs: the last finish over total / CTAs."""
    finish = [0.0] * min(sm_count, len(costs))
    for cost in costs:
        heapq.heapreplace(finish, finish[0] + cost)
    return max(finish) / (sum(costs) / sm_count)


def compare(batch: int, seq_q: int, seq_k: int, heads: int, causal: bool, sm_count: int, tile_cost: float) -> dict:
    """Makespan over ideal for the previous order (group = heads) and today's (group_pairs)."""
    keys = tile_keys(seq_q, seq_k, causal)
    pairs = batch * heads
    group = group_pairs(pairs, keys, sm_count)

    def ratio(g: int) -> float:
        blocks = [-(-keys[t] // BLOCK_N) for _, t in grouped_order(pairs, len(keys), g)]
        return makespan_ratio([b + tile_cost for b in blocks], sm_count)

    return {"group": group, "previous": ratio(heads), "grouped": ratio(group)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--sm", type=int, default=132, help="CTAs of the persistent grid (SMs)")
    parser.add_argument("--tile_cost", type=float, default=2.0, help="per-tile cost, in key blocks")
    parser.add_argument("--shapes", default="16x1024,8x2048,4x4096,2x8192,1x16384,1x32768")
    args = parser.parse_args(argv)
    print("| shape | mask | group (pairs) | previous order | grouped |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        batch, seq = (int(x) for x in shape.split("x"))
        for causal in (True, False):
            r = compare(batch, seq, seq, args.heads, causal, args.sm, args.tile_cost)
            mask = "causal" if causal else "none"
            print(f"| {shape} | {mask} | {r['group']} | {r['previous']:.3f} | {r['grouped']:.3f} |")


if __name__ == "__main__":
    main()
