"""The compiled extension: it imports without a GPU and hands JAX its handler capsules."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import jzyfa

EXPECT_EXTENSION = os.environ.get("JZYFA_EXPECT_EXTENSION") == "1"


def test_import_never_needs_a_gpu():
    # A fresh interpreter with CUDA hidden: importing jzyfa and asking about the kernel works.
    code = "import jzyfa; print(jzyfa.kernel_available()); print(jzyfa.kernel_unavailable_reason())"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], env=env, check=True, capture_output=True, text=True
    )
    assert out.stdout.splitlines()[0] == "False"


@pytest.mark.skipif(not EXPECT_EXTENSION, reason="the extension was not built here (no nvcc)")
def test_extension_registers_its_targets():
    from jzyfa import _jzyfa_ffi

    targets = _jzyfa_ffi.registrations()
    assert set(targets) == {"jzyfa_flash_attention_fwd"}
    assert all(type(c).__name__ == "PyCapsule" for c in targets.values())
    assert jzyfa.extension_loaded(), "registering the FFI targets with JAX failed"
