"""Head dims 64 and 256 on the FP8 kernel, on a Hopper GPU.

Fp8TileT<64>: Q and K rows of 64 bytes, 64-byte swizzled; P V with N = 72 (O's 64 columns and 8 sum
columns). Fp8TileT<256>: 64-key blocks, Q and K rows in two 128-byte slices; P V on N = 256 for O with a
second wgmma of N = 8 for the sums, from one block of ones; O's float32 copy in shared memory. Both
take V^T from the layout kernel whatever the override (the staged kernel transposes 128-byte rows).

Checked: against the emulation (the same algorithm: closely) and against float64 attention of the
dequantized inputs (loosely), outputs NaN-poisoned beforehand, rows that see no key give O = 0 and
LSE = -inf, causal, no mask and a sliding window, Sq != Sk both ways, lengths off the tiles, GQA and MQA,
lean and exact P, bitwise-identical reruns, and the FFI handler's refusal of V as it is.

Skipped without a Hopper GPU and the built extension. Runs the kernel through implementation="kernel"
(the plan's FP8 rows at these head dims). Tolerances are tests/test_fp8_kernel_gpu.py's. The varlen
kernels at these head dims are tests/test_fp8_varlen_kernel_gpu.py's test_head_dims_64_and_256.
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
from plan_rows import add_rows
from test_kernel_gpu import relative_l2

from jzyfa import plan
from jzyfa.plan import FP8_V_LAYOUT_ENV
from jzyfa.primitives import fp8_value_operand_p

pytestmark = [pytest.mark.gpu, requires_hopper]

HEAD_DIMS = (64, 256)
# Keys per block of each head dim's kernel (plan.fp8_key_block; the emulation uses the same).
KEY_BLOCK = {64: 128, 256: 64}

# (batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity): lengths around the 128-row tiles and
# the key blocks and off them, Sq != Sk both ways (bottom-right causal; Sq > Sk leaves the first rows
# without keys), GQA and MQA, per-tensor and per-head descales, 33 or 65 key blocks (promotions of O's
# float32 copy), and a grid where every CTA runs several tiles.
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

head_dims = pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"hd{d}")


@pytest.fixture(autouse=True)
def planned(monkeypatch, request):
    """The plan's rows at the test's head dim (added where the kernel is built but not yet planned)."""
    head_dim = request.node.callspec.params.get("head_dim") if hasattr(request.node, "callspec") else None
    if head_dim is not None:
        add_rows(monkeypatch, "fp8", (head_dim, head_dim))


def fp8_qkv(case, head_dim, seed):
    batch, seq_q, seq_k, heads_q, heads_kv, _, granularity = case
    rng = np.random.default_rng(seed)
    return random_fp8_qkv(
        rng, batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
        granularity=granularity,
    )  # fmt: skip


@head_dims
def test_plan_reads_v_transposed_and_the_key_block(monkeypatch, head_dim):
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "staged")
    common = {"seq_k": 256, "causal": True, "window": (-1, 0)}
    assert plan.fp8_value_layout(256, 2, 2, head_dim=head_dim, **common) == "transposed"
    assert plan.fp8_value_layout(256, 2, 2, head_dim=128, **common) == "staged"
    shape = (1, 4096, 2, head_dim)
    for causal in (True, False):
        assert plan.fp8_key_block(shape, shape, causal=causal) == KEY_BLOCK[head_dim]


@head_dims
@pytest.mark.parametrize("lean_p", [True, False], ids=["lean", "exact"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_against_emulation_and_float64(case, lean_p, head_dim):
    batch, seq_q, seq_k, heads_q, _, causal, _ = case
    (q8, k8, v8), descales = fp8_qkv(case, head_dim, seed=seq_q * 7 + seq_k)
    out, lse, custom_call = run_poisoned_call(q8, k8, v8, descales, causal=causal, lean_p=lean_p)
    assert "v_transposed = true" in custom_call, custom_call
    assert out.shape == (batch, seq_q, heads_q, head_dim)
    assert_matches_references(out, lse, q8, k8, v8, descales, causal=causal, lean_p=lean_p)


@head_dims
@pytest.mark.parametrize("window", [(96, 0), (200, 40)], ids=["left96", "left200-right40"])
def test_sliding_window(window, head_dim):
    case = (2, 700, 700, 4, 2, False, "head")
    (q8, k8, v8), descales = fp8_qkv(case, head_dim, seed=5)
    out, lse = run_poisoned(q8, k8, v8, descales, causal=False, lean_p=True, window=window)
    assert_matches_references(out, lse, q8, k8, v8, descales, causal=False, lean_p=True, window=window)


@head_dims
def test_kernel_is_bitwise_deterministic(head_dim):
    qkv, descales = fp8_qkv((2, 1000, 1000, 8, 2, True, "tensor"), head_dim, seed=11)
    assert_fp8_kernel_reruns_bitwise(*qkv, descales, reruns=20)


@head_dims
def test_handler_takes_vt_and_refuses_v_as_it_is(head_dim):
    """The handler runs V^T [B, Hkv, head_dim, keys] and refuses V as it is with an InvalidArgument that
    says what to pass, not a launch."""
    (q8, k8, v8), descales = fp8_qkv((1, 200, 300, 4, 2, False, "tensor"), head_dim, seed=3)
    vt8 = fp8_value_operand_p.bind(v8)
    assert vt8.shape == (1, 2, head_dim, 320)
    out, lse, _ = jax.block_until_ready(
        ffi_attention(q8, k8, vt8, descales=descales, softmax_scale=0.1, v_transposed=True)
    )
    want_out, _, _ = emulated_on_cpu(q8, k8, v8, descales, causal=False, lean_p=True, softmax_scale=0.1)
    assert relative_l2(np.asarray(out.astype(jnp.float32)), want_out) < EMULATION_TOLERANCE
    assert np.isfinite(np.asarray(lse)).all()
    with pytest.raises(Exception, match=f"v_transposed must be true for the FP8 kernel at head dim {head_dim}"):
        jax.block_until_ready(ffi_attention(q8, k8, v8, descales=descales, softmax_scale=0.1))
