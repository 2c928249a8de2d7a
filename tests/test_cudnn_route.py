"""cuDNN's fused attention on CUDA GPUs without jzyfa's kernel (issue 31, item 6): the routing rule as a
function of the call and the devices, the StableHLO it lowers to for CUDA (no GPU needed), and the
mapping's numerics, run on CPU through jax.nn's XLA implementation in place of its cuDNN one."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_utils import cuda_hlo

import jzyfa
from jzyfa import _platform, cudnn, plan
from jzyfa.plan import Path, Target

CUDNN_VERSION = 91000
HOPPER = Target.of("gpu", "9.0", cudnn_version=CUDNN_VERSION)
HOPPER_WITHOUT_EXTENSION = Target.of(
    "gpu", "9.0", extension_error="the extension could not be imported", cudnn_version=CUDNN_VERSION
)
AMPERE = Target.of("gpu", "8.0", cudnn_version=CUDNN_VERSION)
ADA = Target.of("gpu", "8.9", cudnn_version=CUDNN_VERSION)
BLACKWELL = Target.of("gpu", "10.0", cudnn_version=CUDNN_VERSION)
TURING = Target.of("gpu", "7.5", cudnn_version=CUDNN_VERSION)
AMPERE_WITHOUT_CUDNN = Target.of("gpu", "8.0")
CPU = Target.of("cpu")
TARGETS = {
    "hopper": HOPPER,
    "hopper_no_ext": HOPPER_WITHOUT_EXTENSION,
    "ampere": AMPERE,
    "ada": ADA,
    "blackwell": BLACKWELL,
    "turing": TURING,
    "no_cudnn": AMPERE_WITHOUT_CUDNN,
    "cpu": CPU,
}
K, C, R = Path.PRIMITIVE, Path.CUDNN, Path.REFERENCE

# A call: (dtype, head dims, seq_q, seq_k, mask kind, effective window, lengths, return_lse, softcap).
CALLS = {
    "causal_128": ("bfloat16", (128, 128), 256, 256, "causal", (-1, 0), "none", False, False),
    "none_64_f16": ("float16", (64, 64), 100, 300, "none", (-1, -1), "none", False, False),
    "causal_sq_ne_sk": ("bfloat16", (128, 128), 64, 256, "causal", (-1, 0), "none", False, False),
    "left_window": ("bfloat16", (128, 128), 256, 256, "window", (31, 0), "none", False, False),
    "two_sided_window": ("bfloat16", (128, 128), 256, 256, "window", (31, 31), "none", False, False),
    "head_dim_256": ("bfloat16", (256, 256), 256, 256, "causal", (-1, 0), "none", False, False),
    "mla": ("bfloat16", (192, 128), 256, 256, "causal", (-1, 0), "none", False, False),
    "head_dim_96": ("bfloat16", (96, 96), 256, 256, "none", (-1, -1), "none", False, False),
    "return_lse": ("bfloat16", (128, 128), 256, 256, "causal", (-1, 0), "none", True, False),
    "softcap": ("bfloat16", (128, 128), 256, 256, "causal", (-1, 0), "none", False, True),
    "float32": ("float32", (128, 128), 256, 256, "causal", (-1, 0), "none", False, False),
    "lengths_none": ("bfloat16", (128, 128), 256, 256, "none", (-1, -1), "separate", False, False),
    "lengths_causal_shared": ("bfloat16", (128, 128), 256, 256, "causal", (-1, 0), "shared", False, False),
    "lengths_causal_separate": (
        "bfloat16",
        (128, 128),
        256,
        256,
        "causal",
        (-1, 0),
        "separate",
        False,
        False,
    ),
}
#                     hopper  no_ext ampere ada  blackwell turing no_cudnn cpu
EXPECTED = {
    "causal_128": (K, C, C, C, C, R, R, K),
    "none_64_f16": (K, C, C, C, C, R, R, K),
    "causal_sq_ne_sk": (K, R, R, R, R, R, R, K),
    "left_window": (K, C, C, C, C, R, R, K),
    "two_sided_window": (K, R, R, R, R, R, R, K),
    "head_dim_256": (K, C, R, R, C, R, R, K),
    "mla": (K, R, R, R, R, R, R, K),  # jax.nn takes one head dim for q, k and v
    "head_dim_96": (R, C, C, C, C, R, R, R),
    "return_lse": (K, R, R, R, R, R, R, K),
    "softcap": (R, R, R, R, R, R, R, R),
    "float32": (R, R, R, R, R, R, R, R),
    "lengths_none": (K, C, C, C, C, R, R, K),
    "lengths_causal_shared": (K, C, C, C, C, R, R, K),
    "lengths_causal_separate": (K, R, R, R, R, R, R, K),
}


def _route(call: tuple, target: Target) -> Path:
    dtype, dims, seq_q, seq_k, mask, window, lengths, return_lse, softcap = call
    layout = "dense" if lengths == "none" else "varlen"  # padded batches run on the packed kernels
    problem = plan.config_problem(plan.Config("16bit", dims, mask, layout))
    if dtype not in cudnn.DTYPES:
        problem = f"dtype {dtype}"
    if softcap:
        problem = "softcap"
    cudnn_call = cudnn.Call(
        dtype, dims, seq_q, seq_k, window, lengths, return_lse=return_lse, softcap=softcap
    )
    return plan.default_path(problem, cudnn.problem(cudnn_call, target), target, cpu_primitive=True)


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("target", TARGETS)
def test_routing_by_call_and_device(call, target):
    want = EXPECTED[call][list(TARGETS).index(target)]
    assert _route(CALLS[call], TARGETS[target]) is want


def test_device_problems_name_the_device():
    assert "compute capability 8.0 or later, got 7.5" in cudnn.device_problem(TURING)
    assert "no cuDNN" in cudnn.device_problem(AMPERE_WITHOUT_CUDNN)
    assert "'cpu'" in cudnn.device_problem(CPU)
    assert "9.11" in cudnn.device_problem(Target.of("gpu", "10.3", cudnn_version=91000))
    assert cudnn.device_problem(Target.of("gpu", "10.3", cudnn_version=91100)) is None
    assert cudnn.device_problem(AMPERE) is None


def test_sliding_window_needs_cudnn_9_2():
    call = cudnn.Call("bfloat16", (128, 128), 256, 256, (31, 0))
    assert "9.2" in cudnn.problem(call, Target.of("gpu", "8.0", cudnn_version=90100))
    assert cudnn.problem(call, Target.of("gpu", "8.0", cudnn_version=90200)) is None


def test_target_reads_the_lowest_compute_capability():
    class Device:
        def __init__(self, capability):
            self.compute_capability = capability

    assert _platform.lowest_compute_capability([Device("9.0"), Device("8.9"), Device("10.0")]) == "8.9"
    assert _platform.lowest_compute_capability([Device("9.0"), object()]) is None


def test_target_on_this_cpu_backend():
    target = _platform.target()
    assert target.backend == "cpu" and target.kernel_problem and target.compute_capability is None


# ---- lowering for CUDA on this CPU machine


@pytest.fixture
def on_target(monkeypatch):
    """Routes as on the given devices; jax.nn's cuDNN path traces as with cuDNN 9.10."""
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: CUDNN_VERSION)

    def use(target: Target):
        monkeypatch.setattr(_platform, "target", lambda: target)

    return use


CUDNN_FWD = "__cudnn$fmhaSoftmax"
CUDNN_BWD = "__cudnn$fmhaSoftmaxBackward"


def _targets(hlo: str) -> set[str]:
    import re

    return set(re.findall(r'custom_call_target="([^"]+)"', hlo))


def _qkv(batch=2, seq_q=128, seq_k=128, heads_q=4, heads_kv=2, dim=64, dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    return (
        draw(batch, seq_q, heads_q, dim),
        draw(batch, seq_k, heads_kv, dim),
        draw(batch, seq_k, heads_kv, dim),
    )


@pytest.mark.parametrize(
    "target, want",
    [(AMPERE, CUDNN_FWD), (ADA, CUDNN_FWD), (BLACKWELL, CUDNN_FWD), (HOPPER, "jzyfa_attention_fwd")],
)
def test_forward_lowers_to_the_routed_custom_call(on_target, target, want):
    on_target(target)
    q, k, v = _qkv()
    targets = _targets(cuda_hlo(functools.partial(jzyfa.flash_attention, causal=True), q, k, v))
    assert want in targets
    assert ("jzyfa_attention_fwd" in targets) is (want == "jzyfa_attention_fwd")


@pytest.mark.parametrize(
    "target, want",
    [(AMPERE, {CUDNN_FWD, CUDNN_BWD}), (HOPPER, {"jzyfa_attention_fwd", "jzyfa_attention_bwd"})],
)
def test_gradient_lowers_to_the_routed_backward(on_target, target, want):
    """cuDNN's backward on the cuDNN route; on Hopper jzyfa's forward and backward kernels."""
    on_target(target)
    q, k, v = _qkv()

    def loss(q, k, v):
        return jzyfa.flash_attention(q, k, v, causal=True).astype(jnp.float32).sum()

    targets = _targets(cuda_hlo(jax.grad(loss, argnums=(0, 1, 2)), q, k, v))
    assert want <= targets and not (targets - want)


def test_calls_cudnn_cannot_serve_lower_to_the_reference(on_target):
    on_target(AMPERE)
    q, k, v = _qkv(seq_q=64, seq_k=128)  # causal with seq_q != seq_k: top-left vs bottom-right
    assert not _targets(cuda_hlo(functools.partial(jzyfa.flash_attention, causal=True), q, k, v))
    q, k, v = _qkv()
    hlo = cuda_hlo(functools.partial(jzyfa.flash_attention, causal=True, return_lse=True), q, k, v)
    assert not _targets(hlo)


def test_implementation_xla_and_kernel_are_unchanged(on_target):
    on_target(AMPERE)
    q, k, v = _qkv()
    assert not _targets(cuda_hlo(functools.partial(jzyfa.flash_attention, implementation="xla"), q, k, v))


DROP_IN_CALLS = {
    "causal": ({"is_causal": True}, {}),
    "causal_with_residual": ({"is_causal": True, "return_residual": True}, {}),
    "causal_top_left_sq_ne_sk": ({"is_causal": True}, {"seq_q": 64}),  # jax.nn's own semantics
    "bias": ({"bias": jnp.zeros((1, 4, 128, 128), jnp.bfloat16)}, {}),
    "mask": ({"mask": jnp.tril(jnp.ones((128, 128), bool))[None, None]}, {}),
}


@pytest.mark.parametrize("call", DROP_IN_CALLS)
def test_drop_in_offers_calls_to_jax_nn_cudnn(on_target, call):
    on_target(ADA)
    options, shapes = DROP_IN_CALLS[call]
    q, k, v = _qkv(**shapes)
    hlo = cuda_hlo(functools.partial(jzyfa.dot_product_attention, **options), q, k, v)
    (target,) = _targets(hlo)
    assert target.startswith("__cudnn$fmha")  # __cudnn$fmhaScaleBiasSoftmax with a bias or mask


def test_drop_in_zeroes_padded_query_rows_on_cudnn(monkeypatch):
    """jax.nn's cuDNN path with query lengths (jax.nn's XLA implementation standing in, its padded rows
    made nonzero): the drop-in returns 0 there, as on every other path."""
    original = jax.nn.dot_product_attention

    def garbage_rows(*args, implementation=None, **kwargs):
        q, k, v = (x.astype(jnp.float32) for x in args[:3])
        return original(q, k, v, *args[3:], implementation="xla", **kwargs).astype(args[0].dtype) + 1

    monkeypatch.setattr(jax.nn, "dot_product_attention", garbage_rows)
    monkeypatch.setattr(_platform, "target", lambda: ADA)
    q, k, v = _qkv(batch=3, dtype=jnp.float16)
    lengths = jnp.asarray([128, 5, 0], jnp.int32)
    out = np.asarray(
        jzyfa.dot_product_attention(q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    )
    assert (out[1, 5:] == 0).all() and (out[2] == 0).all() and (out[1, :5] != 0).any()
    assert (out[0] != 0).all()


def test_drop_in_continues_where_jax_nn_cudnn_refuses(on_target):
    on_target(ADA)
    q, k, v = _qkv(dim=256)  # head dim 256 before Hopper: jax.nn's cuDNN path raises at trace time
    hlo = cuda_hlo(functools.partial(jzyfa.dot_product_attention, is_causal=True), q, k, v)
    assert not _targets(hlo)
    q, k, v = (x.astype(jnp.float32) for x in _qkv())
    assert not _targets(cuda_hlo(jzyfa.dot_product_attention, q, k, v))
    on_target(HOPPER)  # the kernel runs: jzyfa's mapping, not jax.nn's cuDNN
    q, k, v = _qkv()
    hlo = cuda_hlo(functools.partial(jzyfa.dot_product_attention, is_causal=True), q, k, v)
    assert _targets(hlo) == {"jzyfa_attention_fwd"}


@pytest.mark.parametrize(
    "error, falls_back",
    [(RuntimeError("cuDNN is not detected."), True), (RuntimeError("device out of memory"), False)],
)
def test_drop_in_falls_back_only_for_cudnn_refusals(monkeypatch, error, falls_back):
    """cuDNN missing is a refusal (jzyfa's mapping or jax.nn's default serves the call); another
    RuntimeError from jax.nn's cuDNN path is the caller's to see."""
    original = jax.nn.dot_product_attention

    def refusing(*args, implementation=None, **kwargs):
        if implementation == "cudnn":
            raise error
        return original(*args, implementation=implementation, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", refusing)
    monkeypatch.setattr(_platform, "target", lambda: ADA)
    q, k, v = (x.astype(jnp.float32) for x in _qkv())
    if falls_back:
        assert jzyfa.dot_product_attention(q, k, v).shape == q.shape
    else:
        with pytest.raises(RuntimeError, match="out of memory"):
            jzyfa.dot_product_attention(q, k, v)


# ---- the mapping's numerics: jax.nn's XLA implementation stands in for its cuDNN one


@pytest.fixture
def cudnn_by_xla(monkeypatch):
    """Routes as on an Ampere GPU, with jax.nn's cuDNN implementation replaced by its XLA one (the same
    semantics, per jax.nn's documentation; in float32, as XLA:CPU needs), so the route's arguments and
    masking run here."""
    calls = []
    original = jax.nn.dot_product_attention

    def by_xla(*args, implementation=None, **kwargs):
        assert implementation == "cudnn"
        calls.append(kwargs)
        q, k, v = (x.astype(jnp.float32) for x in args)  # XLA:CPU has no f16 dot with f32 accumulation
        return original(q, k, v, implementation="xla", **kwargs).astype(args[0].dtype)

    monkeypatch.setattr(jax.nn, "dot_product_attention", by_xla)
    monkeypatch.setattr(_platform, "target", lambda: AMPERE)
    return calls


def _lengths(values):
    return jnp.asarray(values, jnp.int32)


CASES = {
    "none_gqa": {"seq_q": 48, "seq_k": 80},
    "causal": {"causal": True},
    "left_window": {"window": (7, 0)},
    "causal_window": {"causal": True, "window": (5, 9)},
    "lengths_none": {"seq_q": 40, "seq_k": 72, "seqlens_q": [40, 3, 0], "seqlens_k": [72, 0, 50]},
    "lengths_only_k": {"seq_q": 40, "seq_k": 72, "seqlens_k": [72, 9, 100]},
    "lengths_causal_shared": {"causal": True, "shared": [64, 17, 0]},
}


@pytest.mark.parametrize("case", CASES)
def test_route_matches_the_reference(cudnn_by_xla, case):
    options = dict(CASES[case])
    seq_q, seq_k = options.pop("seq_q", 64), options.pop("seq_k", 64)
    if "shared" in options:
        options["seqlens_q"] = options["seqlens_k"] = _lengths(options.pop("shared"))
    for name in ("seqlens_q", "seqlens_k"):
        if isinstance(options.get(name), list):
            options[name] = _lengths(options[name])
    q, k, v = _qkv(batch=3, seq_q=seq_q, seq_k=seq_k, dtype=jnp.float16)

    def loss(fn, q, k, v):
        out = fn(q, k, v, **options)
        return (out.astype(jnp.float32) * jnp.cos(out.astype(jnp.float32))).sum(), out

    grad = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)
    (_, out), grads = jax.jit(grad, static_argnums=0)(jzyfa.flash_attention, q, k, v)
    assert cudnn_by_xla, "the call did not take the cuDNN route"
    reference = functools.partial(jzyfa.flash_attention, implementation="xla")
    (_, want), want_grads = jax.jit(grad, static_argnums=0)(reference, q, k, v)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-3, rtol=2e-3
    )
    for got, expected in zip(grads, want_grads):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(expected, np.float32), atol=2e-2, rtol=2e-2
        )


def test_route_passes_cudnn_its_mask(cudnn_by_xla):
    q, k, v = _qkv(dtype=jnp.float16)
    jzyfa.flash_attention(q, k, v, window=(7, 0))
    assert cudnn_by_xla[-1]["is_causal"] and cudnn_by_xla[-1]["local_window_size"] == (7, 0)
    jzyfa.flash_attention(q, k, v)
    assert "is_causal" not in cudnn_by_xla[-1]
