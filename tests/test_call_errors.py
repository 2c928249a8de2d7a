"""Errors that used to be silent or late (issue 31 item 7): max_seqlen below a concrete sequence's
length, a per-query-head FP8 descale under GQA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzyfa


def _packed(rng, lengths, heads_q=4, heads_kv=2, dim=64):
    total = sum(lengths)
    q = jnp.asarray(rng.standard_normal((total, heads_q, dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((total, heads_kv, dim)), jnp.bfloat16)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return q, k, k, cu


@pytest.mark.parametrize("kind", ["numpy", "device"])
@pytest.mark.parametrize("side", ["q", "k"])
def test_max_seqlen_below_a_concrete_length(rng, kind, side):
    q, k, v, cu = _packed(rng, [8, 40, 5])
    offsets = {"numpy": cu, "device": jnp.asarray(cu)}[kind]
    maxima = {"max_seqlen_q": 40, "max_seqlen_k": 40}
    maxima[f"max_seqlen_{side}"] = 8
    with pytest.raises(
        ValueError, match=rf"max_seqlen_{side} \(8\).*cu_seqlens_{side} \(40\).*max_seqlen_{side}=40"
    ):
        jzyfa.flash_attention_varlen(
            q, k, v, offsets, offsets, maxima["max_seqlen_q"], maxima["max_seqlen_k"]
        )


def test_max_seqlen_enough_passes_and_traced_offsets_are_not_read(rng):
    q, k, v, cu = _packed(rng, [8, 40, 5])
    out = jzyfa.flash_attention_varlen(q, k, v, jnp.asarray(cu), jnp.asarray(cu), 40, 40)
    assert out.shape == q.shape
    # Inside jit the offsets are tracers: the host cannot read them, so no check (documented).
    traced = jax.jit(lambda cu: jzyfa.flash_attention_varlen(q, k, v, cu, cu, 40, 40))(jnp.asarray(cu))
    np.testing.assert_allclose(np.asarray(traced, np.float32), np.asarray(out, np.float32), atol=1e-2)


def test_per_query_head_descale_under_gqa_names_kv_heads(rng):
    q = jnp.asarray(rng.standard_normal((2, 16, 8, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 16, 2, 64)), jnp.bfloat16)
    q8, dq = jzyfa.fp8_quantize(q, "head")
    k8, dk = jzyfa.fp8_quantize(k, "head")
    assert dq.shape == (2, 8)
    with pytest.raises(ValueError, match=r"\[batch, kv_heads\] = \[2, 2\].*kv_heads=2"):
        jzyfa.flash_attention(q8, k8, k8, descale_q=dq, descale_k=dk, descale_v=dk)
    q8, dq = jzyfa.fp8_quantize(q, "head", kv_heads=2)
    assert jzyfa.flash_attention(q8, k8, k8, descale_q=dq, descale_k=dk, descale_v=dk).shape == q.shape
