"""The compiled extension: it imports without a GPU and hands JAX its handler capsules."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import jax
import pytest

import jzyfa
from jzyfa import _extension
from jzyfa.plan import FP8_KEY_BLOCK_ENV, FP8_V_LAYOUT_ENV, fp8_value_layout
from jzyfa.plan import fp8_key_block as fp8_kernel_key_block
from jzyfa.primitives import FFI_TARGET, FFI_TARGET_BWD, FFI_TARGET_INT8_QUANTIZE, FFI_TARGET_VALUE_OPERAND

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
    assert (
        set(targets)
        == {FFI_TARGET, FFI_TARGET_BWD, FFI_TARGET_VALUE_OPERAND, FFI_TARGET_INT8_QUANTIZE}
        == {"jzyfa_attention_fwd", "jzyfa_attention_bwd", "jzyfa_fp8_value_operand", "jzyfa_int8_quantize"}
    )
    assert all(type(c).__name__ == "PyCapsule" for c in targets.values())
    assert jzyfa.extension_loaded(), "registering the FFI targets with JAX failed"
    calls = _extension.handler_calls()
    assert type(calls) is int and calls >= 0
    if jax.default_backend() == "cpu":
        assert calls == 0  # nothing can run the CUDA handler here


# The instantiations the library is built with (ffi/tile_size.h's kFwdKernels and kBwdKernels), as the
# Python plan mirrors them.
BUILT_KERNELS = {
    *(
        ("16bit", qk, v, mask, layout, "fwd")
        for qk, v in ((64, 64), (128, 128), (256, 256), (192, 128))
        for mask in ("none", "causal", "window")
        for layout in ("dense", "varlen")
    ),
    *(
        ("fp8", d, d, mask, layout, "fwd")
        for d in (64, 128, 256)
        for mask in ("none", "causal", "window")
        for layout in ("dense", "varlen")
    ),
    ("fp8", 192, 128, "none", "dense", "fwd"),
    ("fp8", 192, 128, "causal", "dense", "fwd"),
    *(("int8", d, d, mask, "dense", "fwd") for d in (128, 256) for mask in ("none", "causal", "window")),
    *(("int8", 128, 128, mask, "varlen", "fwd") for mask in ("none", "causal", "window")),
    *(("int8", 192, 128, mask, "dense", "fwd") for mask in ("none", "causal")),
    *(
        ("16bit", qk, v, mask, layout, "bwd")
        for qk, v in ((64, 64), (128, 128), (256, 256), (192, 128))
        for mask in ("none", "causal", "window")
        for layout in ("dense", "varlen")
    ),
}


@pytest.mark.skipif(not EXPECT_EXTENSION, reason="the extension was not built here (no nvcc)")
def test_extension_lists_its_instantiations():
    """kernels(): one tuple (family, head_dim_qk, head_dim_v, mask, layout, direction) per instantiation,
    from the table the dispatch switches on; the plan's kernel rows are the same set."""
    from jzyfa import _jzyfa_ffi

    built = _jzyfa_ffi.kernels()
    assert all(type(row) is tuple and len(row) == 6 for row in built), built
    assert len(built) == len(set(built)) == len(BUILT_KERNELS)
    assert set(built) == BUILT_KERNELS


def test_handler_counter_says_why_it_is_unavailable(monkeypatch):
    reason = "the extension jzyfa._jzyfa_ffi could not be imported (No module named 'jzyfa._jzyfa_ffi')"
    monkeypatch.setattr(_extension, "load_error", lambda: reason)
    with pytest.raises(RuntimeError, match=r"handler-call counter is unavailable: the extension .* imported"):
        _extension.handler_calls()


def test_handler_counter_reads_the_extension(monkeypatch):
    monkeypatch.setattr(_extension, "load_error", lambda: None)
    fake = types.SimpleNamespace(registrations=dict, handler_calls=lambda: 7)
    monkeypatch.setitem(sys.modules, _extension.EXTENSION_MODULE, fake)
    assert _extension.handler_calls() == 7
    # An extension built before the counter existed: say so, and how to fix it.
    monkeypatch.setitem(sys.modules, _extension.EXTENSION_MODULE, types.SimpleNamespace(registrations=dict))
    with pytest.raises(RuntimeError, match="has no handler_calls.*rebuild the extension"):
        _extension.handler_calls()


# The dense V^T kernel's rule (ffi/flash_fwd.cc, Fp8KeyBlock): 192-key blocks from this many keys.
WIDE_MIN_KEYS = {True: 3072, False: 1536}  # by causal


@pytest.mark.skipif(not EXPECT_EXTENSION, reason="the extension was not built here (no nvcc)")
@pytest.mark.parametrize("env", [None, "128", "192"])
def test_fp8_key_block_rule(monkeypatch, env):
    """The extension's FP8 key-block rule (key_block 0), which the kernel tests' emulation follows: 192 only
    for the dense kernel with V^T from memory (head dim 128, no window) from WIDE_MIN_KEYS keys, 64 at head
    dim 256 (O's accumulator leaves no room for more), 128 for every other kernel. No environment variable changes it (the launch reads none): forcing a block is the
    key_block attribute's job."""
    from jzyfa import _jzyfa_ffi

    if env is not None:
        monkeypatch.setenv("JZYFA_FP8_KEY_BLOCK", env)
    for v_transposed in (False, True):
        for head_dim in (128, 192, 256):
            for causal, window in ((True, (-1, 0)), (False, (-1, -1)), (True, (100, 0)), (False, (64, 64))):
                for seq_k in (1000, 1535, 1536, 3071, 3072, 8192, 40000):
                    dense_vt = v_transposed and head_dim == 128 and window[0] == -1
                    wide = seq_k >= WIDE_MIN_KEYS[causal]
                    got = _jzyfa_ffi.fp8_key_block(
                        v_transposed=v_transposed, head_dim=head_dim, causal=causal, window_left=window[0],
                        window_right=window[1], seqlen_q=1000, seqlen_k=seq_k,
                    )  # fmt: skip
                    default = 64 if head_dim == 256 else 128
                    assert got == (192 if dense_vt and wide else default), (
                        v_transposed,
                        head_dim,
                        causal,
                        window,
                        seq_k,
                    )


def test_fp8_key_block_without_the_extension(monkeypatch):
    monkeypatch.setattr(_extension, "load_error", lambda: "no extension")
    assert (
        _extension.fp8_key_block(
            v_transposed=True, head_dim=128, causal=True, window=(-1, 0), seq_q=8, seq_k=8
        )
        == 128
    )


def test_fp8_key_block_asks_the_extension(monkeypatch):
    """The call's properties reach the extension by name; an extension built before the function existed
    runs 128-key blocks."""
    calls = []

    def fp8_key_block(**kwargs):
        calls.append(kwargs)
        return 192 if kwargs["v_transposed"] else 128

    monkeypatch.setattr(_extension, "load_error", lambda: None)
    fake = types.SimpleNamespace(registrations=dict, fp8_key_block=fp8_key_block)
    monkeypatch.setitem(sys.modules, _extension.EXTENSION_MODULE, fake)
    assert (
        _extension.fp8_key_block(
            v_transposed=True, head_dim=128, causal=True, window=(5, 0), seq_q=3, seq_k=4
        )
        == 192
    )
    assert calls == [
        dict(
            v_transposed=True,
            head_dim=128,
            causal=True,
            window_left=5,
            window_right=0,
            seqlen_q=3,
            seqlen_k=4,
        )
    ]
    monkeypatch.setitem(sys.modules, _extension.EXTENSION_MODULE, types.SimpleNamespace(registrations=dict))
    assert (
        _extension.fp8_key_block(
            v_transposed=True, head_dim=128, causal=True, window=(5, 0), seq_q=3, seq_k=4
        )
        == 128
    )


def test_fp8_kernel_key_block_reads_the_call_from_shapes(monkeypatch):
    """jzyfa.plan.fp8_key_block (what the GPU tests and tools/fp8_lse_bias.py give the
    emulation as block_n) passes the call's layout, head dim, mask and lengths from q's and k's shapes."""
    calls = []

    def fp8_key_block(**kwargs):
        calls.append(kwargs)
        return 192

    monkeypatch.setattr(_extension, "load_error", lambda: None)
    fake = types.SimpleNamespace(registrations=dict, fp8_key_block=fp8_key_block)
    monkeypatch.setitem(sys.modules, _extension.EXTENSION_MODULE, fake)
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "transposed")
    assert fp8_kernel_key_block((2, 300, 8, 128), (2, 9000, 2, 128), causal=True) == 192
    assert fp8_kernel_key_block((1, 64, 4, 128), (1, 64, 4, 128), causal=False, window=(16, 16)) == 192
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "staged")
    fp8_kernel_key_block((1, 64, 4, 128), (1, 64, 4, 128), causal=False)
    call = dict(head_dim=128, seqlen_q=64, seqlen_k=64)
    assert calls == [
        dict(
            call, v_transposed=True, causal=True, window_left=-1, window_right=0, seqlen_q=300, seqlen_k=9000
        ),
        dict(call, v_transposed=True, causal=False, window_left=16, window_right=16),
        dict(call, v_transposed=False, causal=False, window_left=-1, window_right=-1),
    ]


@pytest.mark.skipif(not EXPECT_EXTENSION, reason="the extension was not built here (no nvcc)")
def test_fp8_layout_rule_asks_the_built_extension(monkeypatch):
    """Few query rows per KV head (staged by rows) go to the V^T layout when the extension's rule gives
    the V^T kernel 192-key blocks (docs/fp8.md 10.30, 10.31): head dim 128, no window, from WIDE_MIN_KEYS
    keys; JZYFA_FP8_KEY_BLOCK=128 gives the staged layout back."""
    monkeypatch.delenv(FP8_V_LAYOUT_ENV, raising=False)
    monkeypatch.delenv(FP8_KEY_BLOCK_ENV, raising=False)

    def layout(seq_k, causal=True, head_dim=128, window=None):
        window = window or ((-1, 0) if causal else (-1, -1))
        return fp8_value_layout(512, 32, 8, seq_k=seq_k, head_dim=head_dim, causal=causal, window=window)

    assert layout(WIDE_MIN_KEYS[False] - 1, causal=False) == "staged"
    assert layout(WIDE_MIN_KEYS[False], causal=False) == "transposed"
    assert layout(WIDE_MIN_KEYS[True] - 1) == "staged"
    assert layout(WIDE_MIN_KEYS[True]) == "transposed"
    assert layout(16384, head_dim=192) == "staged"  # MLA: no 192-key kernel
    assert layout(16384, window=(1023, 0)) == "staged"  # windowed: neither
    monkeypatch.setenv(FP8_KEY_BLOCK_ENV, "128")
    assert layout(16384) == "staged"


@pytest.mark.skipif(not EXPECT_EXTENSION, reason="the extension was not built here (no nvcc)")
def test_tile_group_pairs_rule():
    """The dense kernels' tile order groups (batch, head) pairs (ffi/launch_utils.h TileGroupPairs): the
    smallest divisor of the pairs whose group holds at least 2 x SMs longest tiles of key work, so that
    the last group still balances the grid; every pair in one group when none is that small. (Over a grid
    of calls against tools/tile_order_model.py's copy of the rule: tests/test_tile_order_model.py.)"""
    import importlib

    rule = importlib.import_module(_extension.EXTENSION_MODULE).tile_group_pairs

    def group(pairs, seq_q, seq_k, causal, left=-1, right=-1, block_m=128, sm_count=132):
        return rule(
            pairs=pairs, seqlen_q=seq_q, seqlen_k=seq_k, causal=causal, window_left=left, window_right=right,
            block_m=block_m, sm_count=sm_count,
        )  # fmt: skip

    # The H200's benchmark shapes (16 heads): 16K causal in groups of 8 heads, 32K of 4, 4x4K of one batch
    # element's 16 heads, 16x1K of 64 pairs, 16K without a mask of 4.
    assert group(16, 16384, 16384, True) == 8
    assert group(16, 32768, 32768, True) == 4
    assert group(64, 4096, 4096, True) == 16
    assert group(256, 1024, 1024, True) == 64
    assert group(16, 16384, 16384, False) == 4
    assert group(1, 16384, 16384, True) == 1
    assert group(4, 300, 300, True) == 4  # short: one group
    assert group(13, 16384, 16384, True) == 13  # no divisor between 5 and 13
    # A sliding window: every tile sees about left + 128 keys, so groups of ceil(2 x 132 / 128) -> 4 heads.
    assert group(16, 16384, 16384, True, left=1024, right=0) == 4
