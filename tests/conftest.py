"""Shared fixtures; GPU tests (marked `gpu`) are skipped where the Hopper kernel cannot run."""

import os
import zlib
import sys

import jax
import numpy as np
import pytest

# The sharding tests need a mesh: 8 CPU devices. This must run before any backend starts (gpu_utils
# starts one); it changes only the CPU backend, so GPU tests still see the GPUs.
jax.config.update("jax_num_cpu_devices", 8)

# Test helper modules (attention_oracle, gpu_utils) live next to the tests.
sys.path.insert(0, os.path.dirname(__file__))

from gpu_utils import HOPPER_SKIP_REASON  # noqa: E402


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A NumPy generator seeded from the test's name: reproducible, and different per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def cpu_backend(monkeypatch):
    """Makes jzyfa's dispatch see a CPU default backend, so dispatch tests mean the same on a GPU host."""
    from jzyfa import _platform

    monkeypatch.setattr(_platform, "default_backend", lambda: "cpu")


def pytest_collection_modifyitems(config, items):
    if HOPPER_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=HOPPER_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
