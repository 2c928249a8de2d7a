"""The 16-bit kernel at head dim 256 (64-key blocks) on a Hopper GPU: bf16 and f16, causal and not,
against float64 attention and the pure-JAX path on the GPU, outputs NaN-poisoned beforehand; rows that
see no key give O = 0 and LSE = -inf; GQA; bitwise-identical reruns. (Its sliding windows and varlen
batches: tests/test_wide_kernels_gpu.py.)

Skipped without a Hopper GPU and the built extension. Runs the kernel through implementation="kernel"
(the plan's 16-bit (256, 256) dense rows). Tolerances are tests/test_kernel_gpu.py's.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, random_qkv
from gpu_utils import assert_bitwise_reruns, requires_hopper
from test_kernel_gpu import LSE_TOLERANCE, O_TOLERANCE, relative_l2, run_kernel_poisoned

import jzyfa
from jzyfa.primitives import FFI_TARGET

pytestmark = [pytest.mark.gpu, requires_hopper]

HEAD_DIM = 256


def pure_jax(q, k, v, *, causal):
    """The pure-JAX path on the same device: (out, lse) as NumPy float32."""
    fn = jax.jit(lambda *a: jzyfa.flash_attention(*a, causal=causal, return_lse=True, implementation="xla"))
    out, lse = fn(q, k, v)
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


def check(q, k, v, *, causal):
    """The kernel (into poisoned buffers) against float64 and the pure-JAX path: O and LSE."""
    out, lse = run_kernel_poisoned(q, k, v, causal=causal)
    want_out, want_lse = naive_attention_f64(
        *(np.asarray(x.astype(jnp.float32)) for x in (q, k, v)), causal=causal
    )
    assert not np.isnan(out).any(), "the kernel left elements of O unwritten (NaN poison)"
    assert not np.isnan(lse).any(), "the kernel left LSE entries unwritten (NaN poison)"
    seen = np.isfinite(want_lse)  # [b, h, sq]
    np.testing.assert_array_equal(np.isfinite(lse), seen, "rows with no visible key must give LSE = -inf")
    assert np.all(np.isneginf(lse[~seen])), "rows with no visible key must give LSE = -inf"
    assert np.all(out[~seen.transpose(0, 2, 1)] == 0), "rows with no visible key must give O = 0"
    err = relative_l2(out, want_out)
    assert err < O_TOLERANCE, f"relative L2 error of O against float64 {err:.2e}"
    if seen.any():
        err = relative_l2(lse[seen], want_lse[seen])
        assert err < LSE_TOLERANCE, f"relative L2 error of LSE against float64 {err:.2e}"
    ref_out, ref_lse = pure_jax(q, k, v, causal=causal)
    np.testing.assert_array_equal(np.isfinite(ref_lse), seen)
    err = relative_l2(out, ref_out)
    assert err < O_TOLERANCE, f"relative L2 error of O against the pure-JAX path {err:.2e}"
    if seen.any():
        err = relative_l2(lse[seen], ref_lse[seen])
        assert err < LSE_TOLERANCE, f"relative L2 error of LSE against the pure-JAX path {err:.2e}"


# Around the 64-key block (63, 64, 65) and the 128-row tile, Sq != Sk both ways (bottom-right causal;
# Sq > Sk leaves causal rows with no key), a lone query over many keys.
SEQ_PAIRS = [
    (1, 1),
    (63, 63),
    (64, 64),
    (65, 65),
    (1000, 1000),
    (4097, 4097),
    (63, 1000),
    (1000, 65),
    (65, 1),
    (1, 4097),
]


@pytest.mark.parametrize(
    "dtype,causal,seqs",
    list(itertools.product([jnp.bfloat16, jnp.float16], [True, False], SEQ_PAIRS)),
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_matches_float64_and_the_pure_jax_path(dtype, causal, seqs):
    sq, sk = seqs
    rng = np.random.default_rng([sq, sk, int(causal), int(dtype == jnp.bfloat16)])
    batch, heads_q, heads_kv = (1, 2, 1) if sq * sk > 10**6 else (2, 4, 2)
    q, k, v = random_qkv(
        rng,
        batch=batch,
        seq_q=sq,
        seq_k=sk,
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim=HEAD_DIM,
        dtype=dtype,
    )
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("seqs", [(300, 300), (1000, 700), (700, 1000)])
def test_gqa_8_query_heads_on_2(dtype, seqs):
    rng = np.random.default_rng(seqs[0] * 7 + seqs[1])
    q, k, v = random_qkv(
        rng, batch=2, seq_q=seqs[0], seq_k=seqs[1], heads_q=8, heads_kv=2, head_dim=HEAD_DIM, dtype=dtype
    )
    check(q, k, v, causal=True)


def test_rows_with_no_key_are_zero_and_minus_infinity():
    """Sq > Sk under the causal mask: the first Sq - Sk rows see no key (whole 64-row halves of a tile
    among them, and a partial one)."""
    rng = np.random.default_rng(17)
    q, k, v = random_qkv(rng, batch=1, seq_q=300, seq_k=100, heads_q=2, heads_kv=2, head_dim=HEAD_DIM)
    out, lse = run_kernel_poisoned(q, k, v, causal=True)
    assert np.all(out[:, :200] == 0) and np.all(np.isneginf(lse[:, :, :200]))
    assert np.all(np.isfinite(lse[:, :, 200:]))
    check(q, k, v, causal=True)


def test_bitwise_identical_reruns():
    """Bitwise-identical O and LSE over repeated launches, with other GPU work in between."""
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, batch=2, seq_q=1000, seq_k=1000, heads_q=4, heads_kv=2, head_dim=HEAD_DIM)
    fn = jax.jit(
        lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True, return_lse=True, implementation="kernel")
    )
    assert f'custom_call_target="{FFI_TARGET}"' in fn.lower(q, k, v).as_text(dialect="hlo")
    assert_bitwise_reruns(fn, (q, k, v), reruns=20)
