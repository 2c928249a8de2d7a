"""Shared fixtures; GPU tests (marked `gpu`) are skipped where the Hopper kernel cannot run."""

import os
import re
import sys
import zlib

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
    """A NumPy generator seeded from the test's name: reproducible, and different per test, except that
    a test's FP8 V layouts (`fp8_v_layout`: "staged", "transposed"; "wide" in tests/test_fp8_kernel_gpu.py)
    draw the same inputs, so that
    their CPU references are computed once (tests/content_cache.py) and both layouts face the same data."""
    name = re.sub(r"(?<=[\[-])(staged|transposed|wide)(?=[\]-])", "layout", request.node.nodeid)
    return np.random.default_rng(zlib.crc32(name.encode()))


@pytest.fixture
def cpu_backend(monkeypatch):
    """Makes jzyfa's dispatch see a CPU default backend, so dispatch tests mean the same on a GPU host."""
    from jzyfa import _platform

    monkeypatch.setattr(_platform, "default_backend", lambda: "cpu")


# The FP8 path's V layout and key block overrides, read at trace time (jzyfa/plan.py).
from jzyfa.plan import FP8_KEY_BLOCK_ENV, FP8_V_LAYOUT_ENV


@pytest.fixture(autouse=True)
def fp8_v_layout_rule(monkeypatch):
    """Every test starts from the FP8 V layout and key block rules (no override from the environment);
    tests that want a layout take `fp8_v_layout` or set the variables themselves."""
    monkeypatch.delenv(FP8_V_LAYOUT_ENV, raising=False)
    monkeypatch.delenv(FP8_KEY_BLOCK_ENV, raising=False)


@pytest.fixture(params=["staged", "transposed"])
def fp8_v_layout(request, monkeypatch):
    """Runs a test under each FP8 V layout: V staged and transposed in the kernel, or V^T from the layout
    kernel. The layout is read when a call is traced, so jit's caches are cleared around the test."""
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, request.param)
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


def pytest_collection_modifyitems(config, items):
    if HOPPER_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=HOPPER_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
