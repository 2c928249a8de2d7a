"""tools/barrier_model.py: the kernels' barrier protocol under random schedules. The protocols the
kernels build (one Q buffer, two) run clean; 10.22's early next tile as first built hangs (docs/fp8.md
10.23: a wait on q_full's parity two phases late), its fix does not; a producer that skips its wait for
the Q buffer's release is caught."""

import random

import pytest
from repo_tools import load_tool


@pytest.fixture(scope="module")
def model():
    return load_tool("barrier_model")


@pytest.mark.parametrize("protocol", ["one_q", "two_q", "early_next_tile_fixed"])
def test_built_protocols_run_clean(model, protocol):
    assert model.explore(protocol, runs=1500, seed=1) == []


def test_early_next_tile_as_first_built_hangs(model):
    failures = model.explore("early_next_tile", runs=1500, seed=1)
    errors = [error for _, error in failures]
    assert any(error.startswith("deadlock") for error in errors), errors[:5]
    # The hang needs a one-block tile whose block 0 ran in the last round's tail.
    assert all(1 in tiles[1:] for tiles, _ in failures), failures[:5]


def test_a_wait_two_phases_late_never_returns(model):
    barrier = model.MBarrier(1)
    assert not barrier.passed(0)
    barrier.arrive()
    assert barrier.passed(0) and not barrier.passed(1)
    barrier.arrive()  # the next phase too: parity 0's wait now reads as not complete
    assert not barrier.passed(0) and barrier.passed(1)


def test_a_producer_that_does_not_wait_for_the_q_buffer_is_caught(model, monkeypatch):
    real_wait = model.wait

    def skipping_q_empty(barrier, parity):  # every wait but the producer's on q_empty (by identity)
        if any(barrier is q_empty for q_empty in shared[0].q_empty):
            return lambda: True
        return real_wait(barrier, parity)

    shared = []
    real_shared = model.Shared

    def recording_shared(*args, **kwargs):
        shared[:] = [real_shared(*args, **kwargs)]
        return shared[0]

    monkeypatch.setattr(model, "Shared", recording_shared)
    monkeypatch.setattr(model, "wait", skipping_q_empty)
    outcomes = [model.run([1, 0, 2, 1, 1], "two_q", random.Random(seed)) for seed in range(200)]
    assert any(outcome.error for outcome in outcomes)
