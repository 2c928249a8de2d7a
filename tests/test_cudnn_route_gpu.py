"""On a CUDA GPU: the cuDNN route against the pure-JAX path (values and gradients), and the varlen
kernel path's NaN for traced offsets past max_seqlen. The cuDNN tests run on any CUDA GPU from
compute capability 8.0 with cuDNN; on a Hopper GPU with jzyfa's extension the extension is reported
missing to the routing, so cuDNN serves the calls there too. Marked `gpu` (tools/gpu_session.sh runs
them), so conftest skips them where the Hopper kernel cannot run."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_utils import requires_hopper

import jzyfa
from jzyfa import _platform, cudnn

pytestmark = pytest.mark.gpu
TARGET = _platform.target()
requires_cudnn = pytest.mark.skipif(
    cudnn.device_problem(TARGET) is not None,
    reason=f"needs cuDNN's fused attention: {cudnn.device_problem(TARGET)}",
)


@pytest.fixture
def without_kernel(monkeypatch):
    """The routing sees these devices without jzyfa's kernel."""
    target = dataclasses.replace(
        TARGET, kernel_problem=TARGET.kernel_problem or "reported missing by the test"
    )
    monkeypatch.setattr(_platform, "target", lambda: target)
    return target


def _draw(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


CASES = {
    "causal_128": {"dims": (128, 128), "causal": True},
    "none_sq_ne_sk": {"dims": (64, 64), "seq_q": 200, "seq_k": 328},
    "left_window": {"dims": (128, 128), "window": (63, 0)},
    "gqa_f16": {"dims": (64, 64), "causal": True, "heads": (8, 2), "dtype": jnp.float16},
    "lengths_none": {"dims": (128, 128), "seqlens_q": [256, 100, 0], "seqlens_k": [256, 0, 77]},
    "lengths_causal_shared": {"dims": (128, 128), "causal": True, "shared": [256, 100, 1]},
    "head_dim_256": {"dims": (256, 256), "causal": True, "min_capability": (9, 0)},
}


@requires_cudnn
@pytest.mark.parametrize("case", CASES)
def test_cudnn_route_matches_the_pure_jax_path(rng, without_kernel, case):
    spec = dict(CASES[case])
    capability = tuple(int(p) for p in TARGET.compute_capability.split("."))
    if capability < spec.pop("min_capability", (8, 0)) or TARGET.cudnn_version < spec.pop("min_cudnn", 0):
        pytest.skip("cuDNN does not take this call on this GPU")
    (dim_qk, dim_v), dtype = spec.pop("dims"), spec.pop("dtype", jnp.bfloat16)
    heads_q, heads_kv = spec.pop("heads", (4, 4))
    seq_q, seq_k = spec.pop("seq_q", 256), spec.pop("seq_k", 256)
    if "shared" in spec:
        spec["seqlens_q"] = spec["seqlens_k"] = jnp.asarray(spec.pop("shared"), jnp.int32)
    for name in ("seqlens_q", "seqlens_k"):
        if isinstance(spec.get(name), list):
            spec[name] = jnp.asarray(spec[name], jnp.int32)
    q = _draw(rng, (3, seq_q, heads_q, dim_qk), dtype)
    k = _draw(rng, (3, seq_k, heads_kv, dim_qk), dtype)
    v = _draw(rng, (3, seq_k, heads_kv, dim_v), dtype)

    def loss(fn, q, k, v):
        out = fn(q, k, v, **spec).astype(jnp.float32)
        return (out * jnp.cos(out)).sum(), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    hlo = grad.trace(jzyfa.flash_attention, q, k, v).lower().as_text()
    assert re.search(r"__cudnn\$fmha", hlo), "the call did not take the cuDNN route"
    (_, out), grads = grad(jzyfa.flash_attention, q, k, v)
    (_, want), want_grads = grad(functools.partial(jzyfa.flash_attention, implementation="xla"), q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-2, rtol=2e-2)
    for got, expected in zip(grads, want_grads):
        scale = float(jnp.max(jnp.abs(expected.astype(jnp.float32)))) or 1.0
        np.testing.assert_allclose(
            np.asarray(got, np.float32) / scale, np.asarray(expected, np.float32) / scale, atol=2e-2
        )


@requires_cudnn
def test_drop_in_top_left_causal_on_cudnn(rng, without_kernel):
    q = _draw(rng, (2, 64, 4, 128), jnp.bfloat16)
    k = _draw(rng, (2, 256, 4, 128), jnp.bfloat16)
    fn = jax.jit(functools.partial(jzyfa.dot_product_attention, is_causal=True))
    assert re.search(r"__cudnn\$fmha", fn.trace(q, k, k).lower().as_text())
    want = jax.nn.dot_product_attention(q, k, k, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(fn(q, k, k), np.float32), np.asarray(want, np.float32), atol=2e-2)


@requires_hopper
def test_varlen_kernel_with_traced_offsets_past_the_maxima_is_nan(rng):
    lengths = [100, 300, 7]
    total = sum(lengths)
    q = _draw(rng, (total, 8, 128), jnp.bfloat16)
    k = _draw(rng, (total, 2, 128), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    call = jax.jit(
        lambda q, k, cu, max_q, max_k: jzyfa.flash_attention_varlen(
            q, k, k, cu, cu, max_q, max_k, causal=True
        ),
        static_argnums=(3, 4),
    )
    assert np.isnan(np.asarray(call(q, k, cu, 128, 300), np.float32)).all()  # 300 queries, max 128
    assert np.isnan(np.asarray(call(q, k, cu, 300, 256), np.float32)).all()
    got = call(q, k, cu, 300, 300)
    want = jzyfa.flash_attention_varlen(q, k, k, cu, cu, 300, 300, causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)
