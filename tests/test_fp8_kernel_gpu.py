"""The FP8 kernel on a Hopper GPU: against its emulation (the same algorithm: closely) and against
float64 attention of the dequantized inputs (loosely), outputs NaN-poisoned beforehand; rows that see
no key; bitwise-identical reruns.

Skipped without a Hopper GPU and the built extension. Runs the kernel through
`implementation="kernel"` (the plan's dense FP8 rows, jzyfa.plan.KERNELS).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import random_fp8_qkv
from content_cache import cached_by_content
from fp8_lse_slack import lse_rounding_slack
from gpu_utils import (
    assert_bitwise_reruns,
    assert_equals_per_head_calls,
    kernel_call,
    requires_hopper,
    tile_groups,
)
from test_kernel_gpu import attention_float64, relative_l2

import jzyfa
from jzyfa import plan
from jzyfa.fp8_emulation import trace_attention_fp8_emulated_on_cpu
from jzyfa.plan import FP8_KEY_BLOCK_ENV, FP8_V_LAYOUT_ENV

pytestmark = [pytest.mark.gpu, requires_hopper]

EMULATION_TOLERANCE = 1e-2  # relative L2 of O, kernel against its emulation (same rounded P, mostly)
FLOAT64_TOLERANCE = 8e-2  # relative L2 of O against float64 attention of the dequantized inputs
# Relative L2 of LSE against the emulation, over rows that see a key, of what each row's difference
# has beyond its rounding-tie slack (fp8_lse_slack). Some long rows differ by ~0.007 at LSE ~7, more than
# float32 sums or the ties explain (measured on the H200): hence 1e-3, not noise.
LSE_TOLERANCE = 1e-3


@pytest.fixture(params=["staged", "transposed", "wide"])
def fp8_v_layout(request, monkeypatch):
    """conftest's fixture with the dense V^T kernel's two key blocks forced (JZYFA_FP8_KEY_BLOCK), so that
    both kernels meet every shape whatever the rule picks: "transposed" runs 128-key blocks, "wide" 192
    (V^T from the layout kernel too). Yields the V layout. Traces read the layout: caches cleared."""
    layout = "transposed" if request.param == "wide" else request.param
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, layout)
    monkeypatch.setenv(FP8_KEY_BLOCK_ENV, "192" if request.param == "wide" else "128")
    jax.clear_caches()
    yield layout
    jax.clear_caches()


def kernel_key_block(q8, k8, *, causal, window=None):
    """Keys per block of the kernel that a call on these inputs runs now (128, or 192 for the dense V^T
    kernel)."""
    return plan.fp8_key_block(q8.shape, k8.shape, causal=causal, window=window)


def emulated_on_cpu(q8, k8, v8, descales, *, causal, lean_p, window=None, softmax_scale=None):
    """The kernel's emulation on the CPU with the kernel's key blocks, as NumPy (out float32, lse,
    reference exponents), read-only."""
    block_n = kernel_key_block(q8, k8, causal=causal, window=window)
    return _emulated_on_cpu(
        q8, k8, v8, descales, causal=causal, lean_p=lean_p, window=window, softmax_scale=softmax_scale,
        block_n=block_n,
    )  # fmt: skip


@cached_by_content  # once for both V layouts (conftest's rng gives them the same inputs)
def _emulated_on_cpu(q8, k8, v8, descales, *, causal, lean_p, window, softmax_scale, block_n):
    trace = trace_attention_fp8_emulated_on_cpu(
        q8,
        k8,
        v8,
        *descales,
        causal=causal,
        window=window,
        softmax_scale=softmax_scale,  # None: 1/sqrt(q's head dim), as flash_attention's
        lean_p=lean_p,
        integer_reference=True,
        block_n=block_n,
    )
    results = np.array(trace.out, np.float32), np.array(trace.lse), np.array(trace.reference_exponent)
    for array in results:
        array.setflags(write=False)  # shared by the tests that hit the cache
    return results


# The other slow references, also once per input content.
cached_lse_rounding_slack = cached_by_content(lse_rounding_slack)
cached_attention_float64 = cached_by_content(attention_float64)


def assert_matches_emulation(
    out, lse, q8, k8, v8, descales, *, causal, lean_p, window=None, softmax_scale=None
):
    """Kernel (out, lse) against the emulation: empty rows exactly (O = 0, LSE = -inf), O closely, and
    LSE within LSE_TOLERANCE after each row's rounding-tie slack (a few-key row moves by up to
    ln(1 + 1/8) where its largest probability sits at a tie). Returns the rows that see a key, [B, Hq, Sq]."""
    emu_out, emu_lse, references = emulated_on_cpu(
        q8, k8, v8, descales, causal=causal, lean_p=lean_p, window=window, softmax_scale=softmax_scale
    )
    assert emu_out.shape == out.shape
    seen = np.isfinite(emu_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen, "rows with no visible key must give LSE = -inf")
    assert np.all(np.isneginf(lse[~seen])), "rows with no visible key must give LSE = -inf"
    assert np.all(out[~seen.transpose(0, 2, 1)] == 0), "rows with no visible key must give O = 0"
    err = relative_l2(out, emu_out)
    assert err < EMULATION_TOLERANCE, f"relative L2 of O against the emulation {err:.2e}"
    slack = cached_lse_rounding_slack(
        q8,
        k8,
        descales,
        emu_lse,
        references,
        causal=causal,
        lean_p=lean_p,
        window=window,
        softmax_scale=softmax_scale,
        block_n=kernel_key_block(q8, k8, causal=causal, window=window),
    )
    residual = np.maximum(np.abs(lse[seen] - emu_lse[seen]) - slack[seen], 0.0)
    err = np.linalg.norm(residual) / np.linalg.norm(emu_lse[seen]) if seen.any() else 0.0
    assert err < LSE_TOLERANCE, (
        f"relative L2 of LSE against the emulation beyond rounding ties {err:.2e} "
        f"(without the slack {relative_l2(lse[seen], emu_lse[seen]):.2e})"
    )
    return seen


def run_poisoned(q8, k8, v8, descales, *, causal, lean_p, window=None):
    """The kernel writing into NaN-filled, donated buffers; (out, lse) as NumPy float32."""
    out, lse, _ = run_poisoned_call(q8, k8, v8, descales, causal=causal, lean_p=lean_p, window=window)
    return out, lse


def run_poisoned_call(q8, k8, v8, descales, *, causal, lean_p, window=None):
    """run_poisoned, and the HLO line of the kernel's custom call."""

    def call(q8, k8, v8, dq, dk, dv, out_poison, lse_poison):
        del out_poison, lse_poison
        return jzyfa.flash_attention(
            q8,
            k8,
            v8,
            descale_q=dq,
            descale_k=dk,
            descale_v=dv,
            causal=causal,
            window=window,
            lean_p=lean_p,
            return_lse=True,
            implementation="kernel",
        )

    b, sq, hq, _ = q8.shape
    d = v8.shape[-1]  # out's head dim is v's (MLA: 128 where q has 192)
    poison = (jnp.full((b, sq, hq, d), jnp.nan, jnp.bfloat16), jnp.full((b, hq, sq), jnp.nan, jnp.float32))
    fn = jax.jit(call, donate_argnums=(6, 7), keep_unused=True)
    hlo = fn.lower(q8, k8, v8, *descales, *poison).compile().as_text()
    assert "input_output_alias" in hlo
    custom_call = kernel_call(hlo)  # the one jzyfa_attention_fwd custom call
    assert "varlen = false" in custom_call and f"lean_p = {str(lean_p).lower()}" in custom_call, custom_call
    out, lse = fn(q8, k8, v8, *descales, *poison)
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse), custom_call


@pytest.mark.parametrize("lean_p", [True, False], ids=["lean", "exact"])
@pytest.mark.parametrize(
    "batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity",
    [
        (2, 300, 300, 4, 2, True, "tensor"),
        (1, 1000, 1000, 2, 2, True, "head"),
        (1, 77, 333, 2, 1, True, "tensor"),  # Sk > Sq, Sk not a multiple of 32
        (1, 200, 64, 2, 2, True, "tensor"),  # Sq > Sk: the first 136 rows see no key
        (2, 257, 513, 4, 4, False, "head"),
        # 256 wgmma k-steps per row: without the float32 promotion of O the accumulator's ~14-bit
        # additions put the kernel ~4% away from its emulation here (9% at 16K keys).
        (1, 8192, 8192, 1, 1, True, "tensor"),
        # 384 tiles on the H200's 132 CTAs: every CTA runs two or three tiles in turn (the persistent
        # grid's hand-over from one tile to the next; the cases above give each CTA at most one).
        (4, 1536, 1536, 8, 2, True, "head"),
        # Short tiles in a row on every CTA: 768 tiles of one or two key blocks (each CTA runs about
        # six). A one-block tile frees its Q buffer with its first Q K^T, so the producer can run two
        # tiles ahead of a consumer (a hang the kernel once had).
        (48, 256, 256, 8, 4, True, "tensor"),
        # Tiles with no key (Sq > Sk: rows before Sq - Sk see none) between one-block tiles: 0, 0, 1
        # blocks per sequence, 768 tiles.
        (32, 384, 128, 8, 8, True, "head"),
    ],
)
def test_fp8_kernel_against_emulation_and_float64(
    rng, fp8_v_layout, lean_p, batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity
):
    (q8, k8, v8), descales = random_fp8_qkv(
        rng,
        batch=batch,
        seq_q=seq_q,
        seq_k=seq_k,
        heads_q=heads_q,
        heads_kv=heads_kv,
        granularity=granularity,
    )
    out, lse, custom_call = run_poisoned_call(q8, k8, v8, descales, causal=causal, lean_p=lean_p)
    assert f"v_transposed = {str(fp8_v_layout == 'transposed').lower()}" in custom_call, custom_call
    assert not np.isnan(out).any(), "the kernel left elements of O unwritten (NaN poison)"
    assert not np.isnan(lse).any(), "the kernel left LSE entries unwritten (NaN poison)"

    assert_matches_emulation(out, lse, q8, k8, v8, descales, causal=causal, lean_p=lean_p)

    def dequantized(x8, d, heads):
        d = np.asarray(d, np.float64)
        if d.ndim == 2:  # [B, Hkv] -> per head of x
            d = np.repeat(d, heads // d.shape[1], axis=1)[:, None, :, None]
        return np.asarray(x8.astype(jnp.float32), np.float64) * d

    ref_out, _ = cached_attention_float64(
        dequantized(q8, descales[0], heads_q),
        dequantized(k8, descales[1], heads_kv),
        dequantized(v8, descales[2], heads_kv),
        causal=causal,
        scale=128**-0.5,
    )
    assert relative_l2(out, ref_out) < FLOAT64_TOLERANCE


@pytest.mark.parametrize("lean_p", [True, False], ids=["lean", "exact"])
@pytest.mark.parametrize(
    "batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity",
    [
        (1, 200, 64, 2, 2, True, "tensor"),  # the case whose staged run failed once
        (2, 300, 300, 4, 2, True, "tensor"),
        (2, 257, 513, 4, 4, False, "head"),
        (1, 4096, 4096, 2, 1, True, "tensor"),
    ],
)
def test_staged_and_transposed_v_are_bitwise_equal(
    monkeypatch, lean_p, batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity
):
    """V staged and transposed in the kernel, or V^T from the layout kernel: the same V^T bytes reach the
    same P V in the same 128-key blocks (forced: the rule may pick 192 for V^T), so O and LSE must be
    bitwise equal on the same inputs (several seeds per shape)."""
    monkeypatch.setenv(FP8_KEY_BLOCK_ENV, "128")
    for seed in range(4):
        (q8, k8, v8), descales = random_fp8_qkv(
            np.random.default_rng(seed),
            batch=batch,
            seq_q=seq_q,
            seq_k=seq_k,
            heads_q=heads_q,
            heads_kv=heads_kv,
            granularity=granularity,
        )
        results = {}
        for layout in ("staged", "transposed"):
            monkeypatch.setenv(FP8_V_LAYOUT_ENV, layout)
            jax.clear_caches()  # the layout is read when the call is traced
            out, lse, custom_call = run_poisoned_call(q8, k8, v8, descales, causal=causal, lean_p=lean_p)
            assert f"v_transposed = {str(layout == 'transposed').lower()}" in custom_call
            results[layout] = (out, lse)
        jax.clear_caches()
        for name, a, b in zip(("O", "LSE"), results["staged"], results["transposed"]):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), f"{name}, seed {seed}")


def assert_fp8_kernel_reruns_bitwise(q8, k8, v8, descales, reruns):
    """The causal FP8 kernel call (O and LSE) gives the same bits `reruns` times (gpu_utils)."""
    dq, dk, dv = descales
    fn = jax.jit(
        functools.partial(
            jzyfa.flash_attention,
            descale_q=dq,
            descale_k=dk,
            descale_v=dv,
            causal=True,
            return_lse=True,
            implementation="kernel",
        )
    )
    assert_bitwise_reruns(fn, (q8, k8, v8), reruns=reruns)


def test_fp8_tile_groups_cover_every_tile(rng):
    """A call whose tile order has several groups of (batch, head) pairs (PlanTile: 4 groups of 4 heads
    on the H200) gives, bit for bit, what one call per head gives (a single group each)."""
    assert tile_groups(batch=1, seq_q=16384, seq_k=16384, heads_q=16, causal=False) > 1
    qkv, descales = random_fp8_qkv(rng, batch=1, seq_q=16384, heads_q=16, heads_kv=16)

    def run(q8, k8, v8):
        return run_poisoned(q8, k8, v8, descales, causal=False, lean_p=True)

    assert_equals_per_head_calls(run, *qkv)


def test_fp8_kernel_is_bitwise_deterministic(rng):
    qkv, descales = random_fp8_qkv(rng, batch=2, seq_q=1024, heads_q=8, heads_kv=2)
    assert_fp8_kernel_reruns_bitwise(*qkv, descales, reruns=100)


def test_fp8_wide_kernel_is_bitwise_deterministic(rng, monkeypatch):
    """The same for the 192-key kernel (V^T from the layout kernel, JZYFA_FP8_KEY_BLOCK=192)."""
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "transposed")
    monkeypatch.setenv(FP8_KEY_BLOCK_ENV, "192")
    jax.clear_caches()
    qkv, descales = random_fp8_qkv(rng, batch=2, seq_q=1024, heads_q=8, heads_kv=2)
    assert kernel_key_block(qkv[0], qkv[1], causal=True) == 192
    assert_fp8_kernel_reruns_bitwise(*qkv, descales, reruns=100)
    jax.clear_caches()
