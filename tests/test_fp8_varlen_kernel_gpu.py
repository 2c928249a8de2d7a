"""The FP8 kernel over packed variable-length batches on a Hopper GPU: each sequence's rows against the
dense FP8 kernel run on that sequence alone (a tile's key blocks start at its sequence's first key, so
the arithmetic is the same: bitwise) and loosely against float64 attention of the dequantized inputs;
outputs NaN-poisoned beforehand; rows that see no key and tokens of no sequence give O = 0 and
LSE = -inf; per-tensor and per-(sequence, KV head) descales, GQA, causal or not, a sliding window;
bitwise-identical reruns. Every case runs under both V layouts (the `fp8_v_layout` fixture: the varlen
V^T from the layout kernel, the default, and V staged in the kernel), the dense oracle under the same one.

Skipped without a Hopper GPU and the built extension. Runs the kernel through implementation="kernel"
(the plan's FP8 varlen rows). Few, small cases: about a minute on an H200.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import dequantized_f64, naive_varlen_f64, random_fp8_packed
from gpu_utils import has_custom_call, kernel_call, requires_hopper
from plan_rows import add_rows
from test_fp8_kernel_gpu import FLOAT64_TOLERANCE
from test_fp8_window_kernel_gpu import ONE_CODE_LSE
from test_kernel_gpu import relative_l2

import jzyfa
from jzyfa.plan import FP8_KEY_BLOCK_ENV, fp8_varlen_value_layout
from jzyfa.primitives import FFI_TARGET_VALUE_OPERAND

pytestmark = [pytest.mark.gpu, requires_hopper, pytest.mark.usefixtures("fp8_v_layout")]

LENGTHS = [1, 63, 64, 65, 0, 127, 129, 300, 1000]  # around block edges; an empty sequence


def run_poisoned(q8, k8, v8, descales, cu_q, cu_k, *, causal, window=None):
    """The varlen kernel writing into NaN-filled, donated buffers: (out, lse) as NumPy float32."""
    max_q, max_k = int(np.diff(cu_q).max()), int(np.diff(cu_k).max())

    def call(q8, k8, v8, cu_q, cu_k, dq, dk, dv, out_poison, lse_poison):
        del out_poison, lse_poison  # donated: their buffers become the results
        return jzyfa.flash_attention_varlen(
            q8, k8, v8, cu_q, cu_k, max_q, max_k, causal=causal, window=window, return_lse=True,
            implementation="kernel", descale_q=dq, descale_k=dk, descale_v=dv,
        )  # fmt: skip

    poison = (jnp.full(q8.shape, jnp.nan, jnp.bfloat16), jnp.full(q8.shape[1::-1], jnp.nan, jnp.float32))
    args = (q8, k8, v8, jnp.asarray(cu_q), jnp.asarray(cu_k), *descales, *poison)
    fn = jax.jit(call, donate_argnums=(8, 9), keep_unused=True)
    hlo = fn.lower(*args).compile().as_text()
    custom_call = kernel_call(hlo)  # the one jzyfa_attention_fwd custom call
    # The varlen V^T's layout kernel runs first exactly when the layout is "transposed".
    transposed = fp8_varlen_value_layout(max_q, q8.shape[1], k8.shape[1], head_dim=q8.shape[-1]) == "transposed"
    assert "varlen = true" in custom_call and f"v_transposed = {str(transposed).lower()}" in custom_call
    assert f"max_seqlen_q = {max_q} : i64" in custom_call and f"max_seqlen_k = {max_k} : i64" in custom_call
    assert has_custom_call(hlo, FFI_TARGET_VALUE_OPERAND) == transposed, hlo
    assert "input_output_alias" in hlo
    out, lse = fn(*args)
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


def dense_kernel_per_sequence(q8, k8, v8, descales, cu_q, cu_k, *, causal, window=None):
    """Each sequence with queries and keys alone through the dense FP8 kernel: {s: (out, lse)}."""
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        # The varlen kernel's 128-key blocks, whatever the dense V^T kernel's rule picks (launch-time).
        patch.setenv(FP8_KEY_BLOCK_ENV, "128")
        for s in range(len(cu_q) - 1):
            rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
            if cu_q[s + 1] == cu_q[s] or cu_k[s + 1] == cu_k[s]:
                continue
            ds = [d if d.ndim < 2 else d[s : s + 1] for d in descales]
            out, lse = jzyfa.flash_attention(
                q8[None, rows], k8[None, keys], v8[None, keys], causal=causal, window=window, return_lse=True,
                implementation="kernel", descale_q=ds[0], descale_k=ds[1], descale_v=ds[2],
            )  # fmt: skip
            results[s] = (np.asarray(out[0].astype(jnp.float32)), np.asarray(lse[0]))
    return results


def check(
    rng, lengths_q, lengths_k, *, causal, per_head, pad_q=0, window=None, heads_q=8, heads_kv=2, head_dim=128
):
    (q8, k8, v8), descales, cu_q, cu_k = random_fp8_packed(
        rng, lengths_q, lengths_k, heads_q=heads_q, heads_kv=heads_kv, pad_q=pad_q, per_head=per_head,
        head_dim=head_dim,
    )  # fmt: skip
    out, lse = run_poisoned(q8, k8, v8, descales, cu_q, cu_k, causal=causal, window=window)
    assert not np.isnan(out).any(), "the kernel left elements of O unwritten (NaN poison)"
    assert not np.isnan(lse).any(), "the kernel left LSE entries unwritten (NaN poison)"

    # Each sequence: the dense kernel's numbers exactly (same key blocks, same descales, same P).
    for s, (want_out, want_lse) in dense_kernel_per_sequence(
        q8, k8, v8, descales, cu_q, cu_k, causal=causal, window=window
    ).items():
        rows = slice(cu_q[s], cu_q[s + 1])
        np.testing.assert_array_equal(out[rows], want_out, f"sequence {s}: O differs from the dense kernel's")
        np.testing.assert_array_equal(
            lse[:, rows], want_lse, f"sequence {s}: LSE differs from the dense kernel's"
        )

    f64 = [dequantized_f64(x, d, cu) for x, d, cu in zip((q8, k8, v8), descales, (cu_q, cu_k, cu_k))]
    ref_out, ref_lse = naive_varlen_f64(*f64, cu_q, cu_k, causal=causal, window=window)
    seen = np.isfinite(ref_lse)  # [Hq, total_q]; tokens of no sequence and rows with no key: False
    np.testing.assert_array_equal(np.isfinite(lse), seen, "rows with no visible key must give LSE = -inf")
    assert np.all(np.isneginf(lse[~seen]))
    assert np.all(out[~seen.T] == 0), "rows with no visible key and tokens of no sequence must give O = 0"
    assert relative_l2(out, ref_out) < FLOAT64_TOLERANCE
    # The row sums add the e4m3-rounded probabilities: within one code of the largest (2^-3) per row.
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=0, atol=ONE_CODE_LSE)
    return (q8, k8, v8), descales, cu_q, cu_k, out, lse


@pytest.mark.parametrize(
    "causal, per_head",
    [(True, True), (False, False)],
    ids=["causal-per-head", "full-per-tensor"],
)
def test_unequal_lengths_against_dense_kernel_and_float64(rng, causal, per_head):
    # 5 tokens past cu_seqlens_q[-1] belong to no sequence.
    check(rng, LENGTHS, LENGTHS, causal=causal, per_head=per_head, pad_q=5)


def test_more_keys_than_queries_and_sequences_without_keys(rng):
    # Sequence 1: keys but no query; sequence 2: queries but no key (O = 0, LSE = -inf).
    check(rng, [100, 0, 7, 250], [300, 50, 0, 129], causal=True, per_head=True)


def test_many_short_sequences(rng):
    # 64 sequences of 1 to 3 key blocks, 896 tiles: every CTA runs several short tiles in a row.
    lengths = [1, 129, 64, 300] * 16
    check(rng, lengths, lengths, causal=True, per_head=True)


def test_sliding_window(rng):
    # A window that is neither causal nor none for these lengths: the windowed instantiation.
    check(rng, [65, 300, 1000], [65, 300, 1000], causal=False, per_head=True, window=(96, 0))


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (False, (96, 0))])
def test_head_dims_64_and_256(rng, monkeypatch, causal, window, head_dim):
    """The head-dim-64 and -256 varlen kernels (V^T from memory whatever the layout override says: the
    in-kernel transpose takes 128-byte rows only)."""
    add_rows(monkeypatch, "fp8", (head_dim, head_dim), layouts=("varlen",))  # built, planned or not yet
    check(rng, LENGTHS, LENGTHS, causal=causal, per_head=True, pad_q=3, window=window, head_dim=head_dim)


def test_reruns_are_bitwise_identical(rng):
    (q8, k8, v8), descales, cu_q, cu_k, out, lse = check(rng, LENGTHS, LENGTHS, causal=True, per_head=False)
    again = run_poisoned(q8, k8, v8, descales, cu_q, cu_k, causal=True)
    np.testing.assert_array_equal(again[0], out)
    np.testing.assert_array_equal(again[1], lse)
