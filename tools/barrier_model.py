"""A model of the forward kernels' barrier protocol, run under random schedules: the producer thread
(ProduceTiles), the two consumer warpgroups with their ping-pong turns, the TMA loads landing late,
each mbarrier with its phase, and waits that test a parity (as `mbarrier.try_wait.parity` does: a
wait for the phase of parity p returns once the barrier's current phase has the other parity, so a
barrier two phases ahead reads as not complete). It reports deadlocks, a tile index read after the
producer overwrote it, and a Q buffer or K/V stage refilled while a consumer still reads it.

Protocols (--protocol):
- one_q: the kernels as they are (one Q buffer: the next tile's Q once both consumers' last Q K^T
  has landed);
- two_q: a second Q buffer (docs/fp8.md 10.24, -DJZYFA_FP8_Q_PREFETCH / -DJZYFA_Q_PREFETCH);
- early_next_tile: docs/fp8.md 10.22 as first built (the next tile's block 0 in the last turn; a
  one-block tile releases its Q buffer there, then the next round waits on q_full again): hangs;
- early_next_tile_fixed: 10.23's fix (that release moved after the next round's wait).

    python tools/barrier_model.py --protocol two_q --runs 2000
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

PROTOCOLS = ("one_q", "two_q", "early_next_tile", "early_next_tile_fixed")
SENTINEL = -1  # the tile index that tells the consumers to stop


class ProtocolError(Exception):
    """A hazard: data read after it was overwritten, or a buffer refilled while in use."""


@dataclass
class MBarrier:
    """An mbarrier: `count` arrivals complete a phase; phase counts the completed ones."""

    count: int
    pending: int = 0
    phase: int = 0

    def __post_init__(self):
        self.pending = self.count

    def arrive(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def passed(self, parity: int) -> bool:
        """try_wait.parity(parity): the current phase's parity differs from the one waited for."""
        return (self.phase & 1) != parity


@dataclass
class NamedBarrier:
    """bar.sync / bar.arrive over `count` threads; each consumer process stands for 128 of them."""

    count: int = 256
    arrived: int = 0
    generation: int = 0

    def arrive(self) -> int:
        """Adds one warpgroup's arrival; returns the generation it belongs to."""
        generation = self.generation
        self.arrived += 128
        if self.arrived == self.count:
            self.arrived = 0
            self.generation += 1
        return generation


@dataclass
class Shared:
    """The CTA's shared state: barriers, the published tile indices, who uses which buffer."""

    q_buffers: int
    stages: int
    q_full: list[MBarrier] = field(default_factory=list)
    q_empty: list[MBarrier] = field(default_factory=list)
    k_full: list[MBarrier] = field(default_factory=list)
    v_full: list[MBarrier] = field(default_factory=list)
    k_empty: list[MBarrier] = field(default_factory=list)
    v_empty: list[MBarrier] = field(default_factory=list)
    turns: list[NamedBarrier] = field(default_factory=lambda: [NamedBarrier(), NamedBarrier()])
    tile: list[int] = field(default_factory=list)
    tile_blocks: list[int] = field(default_factory=list)
    # Which (round or ring position) each Q buffer and K/V stage holds, and who reads it now.
    q_round: list[int] = field(default_factory=list)
    q_readers: list[set] = field(default_factory=list)
    published: dict[int, int] = field(default_factory=dict)  # round -> tile index

    def __post_init__(self):
        self.q_full = [MBarrier(1) for _ in range(self.q_buffers)]
        self.q_empty = [MBarrier(2) for _ in range(self.q_buffers)]
        self.k_full = [MBarrier(1) for _ in range(self.stages)]
        self.v_full = [MBarrier(1) for _ in range(self.stages)]
        self.k_empty = [MBarrier(2) for _ in range(self.stages)]
        self.v_empty = [MBarrier(2) for _ in range(self.stages)]
        self.tile = [0] * self.q_buffers
        self.tile_blocks = [0] * self.q_buffers
        self.q_round = [-1] * self.q_buffers
        self.q_readers = [set() for _ in range(self.q_buffers)]


# A process yields a predicate (run again once it holds) or None (yield the processor).
Process = Generator[Callable[[], bool] | None, None, None]


def wait(barrier: MBarrier, parity: int) -> Callable[[], bool]:
    return lambda: barrier.passed(parity)


def slot(n: int, size: int) -> tuple[int, int]:
    """RingSlot<size>(n): (stage, parity)."""
    return n % size, (n // size) & 1


def producer(sh: Shared, tiles: Sequence[int], spawn: Callable[[Process], None]) -> Process:
    """ProduceTiles: `tiles` are the block counts of the tiles this CTA claims, in order."""

    def landing(barrier: MBarrier) -> Process:  # a TMA load: its bytes arrive some time later
        yield None
        barrier.arrive()

    ring = 0
    for round_ in range(len(tiles) + 1):
        b, parity = slot(round_, sh.q_buffers)
        if round_ >= sh.q_buffers:
            yield wait(sh.q_empty[b], parity ^ 1)
        if round_ == len(tiles):
            sh.tile[b], sh.tile_blocks[b] = SENTINEL, 0
            sh.published[round_] = SENTINEL
            sh.q_full[b].arrive()
            return
        blocks = tiles[round_]
        sh.tile[b], sh.tile_blocks[b] = round_, blocks
        sh.published[round_] = round_
        if blocks == 0:
            sh.q_full[b].arrive()
            continue
        if sh.q_readers[b]:
            raise ProtocolError(f"Q buffer {b} refilled for round {round_} while {sh.q_readers[b]} read it")
        sh.q_round[b] = round_
        spawn(landing(sh.q_full[b]))
        for _ in range(blocks):
            stage, parity = slot(ring, sh.stages)
            if ring >= sh.stages:
                yield wait(sh.k_empty[stage], parity ^ 1)
            spawn(landing(sh.k_full[stage]))
            if ring >= sh.stages:
                yield wait(sh.v_empty[stage], parity ^ 1)
            spawn(landing(sh.v_full[stage]))
            ring += 1
        yield None


def consumer(sh: Shared, c: int, protocol: str) -> Process:
    """One consumer warpgroup's tile loop, its GEMMs as issue (in a turn) and wait."""
    early = protocol.startswith("early_next_tile")

    def begin_turn() -> Process:
        generation = sh.turns[c].arrive()
        yield lambda: sh.turns[c].generation > generation

    def end_turn() -> None:
        sh.turns[1 - c].arrive()

    def read_tile(round_: int) -> int:
        b, _ = slot(round_, sh.q_buffers)
        tile = sh.tile[b]
        if sh.published.get(round_) != tile:
            raise ProtocolError(f"consumer {c} read tile {tile} for round {round_}: overwritten")
        return tile

    def take_q(round_: int) -> None:
        b, _ = slot(round_, sh.q_buffers)
        if sh.tile[b] != SENTINEL and sh.tile_blocks[b] > 0 and sh.q_round[b] != round_:
            raise ProtocolError(f"consumer {c}: Q buffer {b} holds round {sh.q_round[b]}, not {round_}")
        sh.q_readers[b].add(c)

    def release_q(round_: int) -> None:
        b, _ = slot(round_, sh.q_buffers)
        sh.q_readers[b].discard(c)
        sh.q_empty[b].arrive()

    if c == 1:
        end_turn()  # consumer 0 takes the first turn
    ring = 0
    started = False  # early: this round's block 0 ran in the last round's tail
    for round_ in range(10**9):
        b, parity = slot(round_, sh.q_buffers)
        yield wait(sh.q_full[b], parity)
        tile = read_tile(round_)
        if tile == SENTINEL:
            break
        blocks = sh.tile_blocks[b]
        if blocks == 0:
            release_q(round_)
            continue
        if not started:
            take_q(round_)
            stage, parity = slot(ring, sh.stages)
            yield wait(sh.k_full[stage], parity)
            yield from begin_turn()
            end_turn()
            sh.k_empty[stage].arrive()  # S landed
            if blocks == 1:
                release_q(round_)
        elif protocol == "early_next_tile_fixed" and blocks == 1:
            release_q(round_)
        for block in range(1, blocks):
            stage, parity = slot(ring + block, sh.stages)
            yield wait(sh.k_full[stage], parity)
            yield from begin_turn()
            prev, prev_parity = slot(ring + block - 1, sh.stages)
            yield wait(sh.v_full[prev], prev_parity)
            end_turn()
            sh.k_empty[stage].arrive()
            if block == blocks - 1:
                release_q(round_)
            sh.v_empty[prev].arrive()  # the previous P V landed
        last, last_parity = slot(ring + blocks - 1, sh.stages)
        yield wait(sh.v_full[last], last_parity)
        next_started = False
        if early:
            nb, n_parity = slot(round_ + 1, sh.q_buffers)
            yield wait(sh.q_full[nb], n_parity)
            next_tile = read_tile(round_ + 1)
            next_blocks = sh.tile_blocks[nb] if next_tile != SENTINEL else 0
            next_started = next_blocks > 0
            if next_started:
                first, first_parity = slot(ring + blocks, sh.stages)
                yield wait(sh.k_full[first], first_parity)
                take_q(round_ + 1)  # its Q K^T goes into the last turn
        yield from begin_turn()
        end_turn()  # the last P V (and, early, the next tile's block 0 Q K^T)
        sh.v_empty[last].arrive()
        ring += blocks
        if next_started:
            sh.k_empty[slot(ring, sh.stages)[0]].arrive()
            if next_blocks == 1 and protocol == "early_next_tile":
                release_q(round_ + 1)  # 10.22 as first built: before the next round's wait
        started = next_started
        yield None
    if c == 0:
        yield from begin_turn()  # consumer 1's last hand-over


@dataclass
class Outcome:
    error: str | None
    steps: int


def run(tiles: Sequence[int], protocol: str, rng: random.Random, stages: int = 2) -> Outcome:
    """One random schedule of one CTA's tiles (their block counts) under `protocol`."""
    sh = Shared(q_buffers=1 if protocol == "one_q" else 2, stages=stages)
    procs: list[tuple[Process, Callable[[], bool] | None]] = []

    def spawn(p: Process) -> None:
        procs.append((p, None))

    spawn(consumer(sh, 0, protocol))
    spawn(consumer(sh, 1, protocol))
    spawn(producer(sh, tiles, spawn))
    steps = 0
    while procs:
        ready = [i for i, (_, cond) in enumerate(procs) if cond is None or cond()]
        if not ready:
            return Outcome("deadlock: every process waits", steps)
        i = rng.choice(ready)
        p, _ = procs[i]
        steps += 1
        try:
            cond = next(p)
        except StopIteration:
            procs.pop(i)
            continue
        except ProtocolError as e:
            return Outcome(str(e), steps)
        procs[i] = (p, cond)
    return Outcome(None, steps)


def explore(protocol: str, runs: int, seed: int = 0, max_tiles: int = 6) -> list[tuple[list[int], str]]:
    """Random tile sequences (0 to 3 blocks, short ones often) under random schedules: the failures."""
    rng = random.Random(seed)
    failures = []
    for _ in range(runs):
        tiles = [rng.choice((0, 1, 1, 1, 2, 3)) for _ in range(rng.randint(1, max_tiles))]
        outcome = run(tiles, protocol, rng)
        if outcome.error:
            failures.append((tiles, outcome.error))
    return failures


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", choices=PROTOCOLS, default="two_q")
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    failures = explore(args.protocol, args.runs, args.seed)
    print(f"{args.protocol}: {len(failures)} of {args.runs} random runs failed")
    for tiles, error in failures[:5]:
        print(f"  tiles {tiles}: {error}")


if __name__ == "__main__":
    main()
