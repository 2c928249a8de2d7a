"""Head dim 64 on the FP8 kernel (Fp8TileT<64>: Q and K rows of 64 bytes, 64-byte swizzled; P V with N =
72, O's 64 columns and 8 sum columns; V^T always from the layout kernel), on a Hopper GPU: against its
emulation (the same algorithm: closely) and against float64 attention of the dequantized inputs
(loosely), outputs NaN-poisoned beforehand, rows that see no key give O = 0 and LSE = -inf, causal, no
mask and a sliding window, Sq != Sk both ways, lengths off the 128-row and 128-key tiles, GQA and MQA,
lean and exact P, bitwise-identical reruns, and the FFI handler's refusal of V as it is.

Skipped without a Hopper GPU and the built extension. Runs the kernel through implementation="kernel"
(the plan's FP8 rows at head dims 64/64). Tolerances are tests/test_fp8_kernel_gpu.py's. The varlen
kernel at head dim 64 is tests/test_fp8_varlen_kernel_gpu.py's test_head_dim_64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import random_fp8_qkv
from gpu_utils import ffi_attention, requires_hopper
from test_fp8_kernel_gpu import (
    EMULATION_TOLERANCE,
    assert_fp8_kernel_reruns_bitwise,
    emulated_on_cpu,
    run_poisoned,
    run_poisoned_call,
)
from test_fp8_mla_kernel_gpu import assert_matches_references, case_id
from test_kernel_gpu import relative_l2

from jzyfa import plan
from jzyfa.plan import FP8_V_LAYOUT_ENV
from jzyfa.primitives import fp8_value_operand_p

pytestmark = [pytest.mark.gpu, requires_hopper]

HEAD_DIM = 64

# (batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity): lengths around the 128-row and 128-key
# tiles and off them, Sq != Sk both ways (bottom-right causal; Sq > Sk leaves the first rows without
# keys), GQA and MQA, per-tensor and per-head descales, 33 key blocks (promotions of O's float32 copy),
# and a grid where every CTA runs several tiles.
CASES = [
    (2, 300, 300, 4, 2, True, "tensor"),
    (1, 1000, 1000, 8, 2, True, "head"),
    (1, 1000, 1000, 8, 1, False, "tensor"),
    (1, 77, 333, 2, 1, True, "tensor"),  # Sk > Sq, Sk not a multiple of 32
    (1, 200, 64, 2, 2, True, "tensor"),  # Sq > Sk: the first 136 rows see no key
    (2, 257, 513, 4, 4, False, "head"),
    (1, 1, 1, 8, 2, True, "tensor"),
    (1, 4097, 4097, 4, 1, True, "tensor"),
    (4, 1536, 1536, 8, 2, True, "head"),  # 384 tiles on 132 CTAs
]


def fp8_qkv(case, seed):
    batch, seq_q, seq_k, heads_q, heads_kv, _, granularity = case
    rng = np.random.default_rng(seed)
    return random_fp8_qkv(
        rng, batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv, head_dim=HEAD_DIM,
        granularity=granularity,
    )  # fmt: skip


def test_plan_reads_v_transposed_at_head_dim_64(monkeypatch):
    """The staged kernel transposes 128-byte rows only: head dim 64 takes V^T whatever the override."""
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "staged")
    common = {"seq_k": 256, "causal": True, "window": (-1, 0)}
    assert plan.fp8_value_layout(256, 2, 2, head_dim=HEAD_DIM, **common) == "transposed"
    assert plan.fp8_value_layout(256, 2, 2, head_dim=128, **common) == "staged"


@pytest.mark.parametrize("lean_p", [True, False], ids=["lean", "exact"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fp8_hd64_kernel_against_emulation_and_float64(case, lean_p):
    batch, seq_q, seq_k, heads_q, _, causal, _ = case
    (q8, k8, v8), descales = fp8_qkv(case, seed=seq_q * 7 + seq_k)
    out, lse, custom_call = run_poisoned_call(q8, k8, v8, descales, causal=causal, lean_p=lean_p)
    assert "v_transposed = true" in custom_call, custom_call
    assert out.shape == (batch, seq_q, heads_q, HEAD_DIM)
    assert_matches_references(out, lse, q8, k8, v8, descales, causal=causal, lean_p=lean_p)


@pytest.mark.parametrize("window", [(96, 0), (200, 40)], ids=["left96", "left200-right40"])
def test_fp8_hd64_sliding_window(window):
    case = (2, 700, 700, 4, 2, False, "head")
    (q8, k8, v8), descales = fp8_qkv(case, seed=5)
    out, lse = run_poisoned(q8, k8, v8, descales, causal=False, lean_p=True, window=window)
    assert_matches_references(out, lse, q8, k8, v8, descales, causal=False, lean_p=True, window=window)


def test_fp8_hd64_kernel_is_bitwise_deterministic():
    qkv, descales = fp8_qkv((2, 1000, 1000, 8, 2, True, "tensor"), seed=11)
    assert_fp8_kernel_reruns_bitwise(*qkv, descales, reruns=20)


def test_handler_takes_vt_and_refuses_v_as_it_is_at_head_dim_64():
    """The handler runs V^T [B, Hkv, 64, keys] and refuses V as it is with an InvalidArgument that says
    what to pass, not a launch."""
    (q8, k8, v8), descales = fp8_qkv((1, 200, 300, 4, 2, False, "tensor"), seed=3)
    vt8 = fp8_value_operand_p.bind(v8)
    assert vt8.shape == (1, 2, HEAD_DIM, 320)
    out, lse, _ = jax.block_until_ready(
        ffi_attention(q8, k8, vt8, descales=descales, softmax_scale=0.1, v_transposed=True)
    )
    want_out, _, _ = emulated_on_cpu(q8, k8, v8, descales, causal=False, lean_p=True, softmax_scale=0.1)
    assert relative_l2(np.asarray(out.astype(jnp.float32)), want_out) < EMULATION_TOLERANCE
    assert np.isfinite(np.asarray(lse)).all()
    with pytest.raises(Exception, match="v_transposed must be true for the FP8 kernel at head dim 64"):
        jax.block_until_ready(ffi_attention(q8, k8, v8, descales=descales, softmax_scale=0.1))
