"""The FP8 (e4m3) kernels' JAX side on the CPU, for every FP8 row of `jzyfa.plan.KERNELS` (head dim 128:
masks none, causal, window, dense and varlen; MLA's 192/128: none and causal, dense): which path a call
takes per `implementation`, the CUDA custom call `jzyfa_attention_fwd` (operands, descales flattened,
attributes, windows canonicalised), V's operand layout (staged or V^T from `jzyfa_fp8_value_operand`: the
rule, its overrides, the key block rule and JZYFA_FP8_KEY_BLOCK), what is refused outside the table and
why, the window token limit, the primitive's CPU lowering (dense: the kernel's emulation; varlen: V^T
inverted where transposed, then dequantize + the exact reference), vmap, head sharding, the varlen
V^T layout and the value-operand primitive. (The kernels themselves: tests/test_fp8_*_gpu.py and
tests/test_kernel_build.py; the table itself: tests/test_plan.py.)"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import dequantized_f64, naive_varlen_f64, offsets, random_fp8_packed, random_qkv
from hlo_utils import cuda_hlo, custom_call_lines, window_attributes
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_utils import cpu_mesh
from plan_rows import add_rows
from test_extension import WIDE_MIN_KEYS

import jzyfa
from jzyfa import _platform, plan, primitives
from jzyfa.fp8_emulation import attention_fp8_emulated
from jzyfa.fp8_layout import (
    KEY_GROUP,
    KEY_PERMUTATION,
    fp8_value_operand,
    fp8_varlen_value_operand,
    padded_keys,
    varlen_padded_keys,
    varlen_value_columns,
    varlen_value_from_operand,
)
from jzyfa.plan import FP8_KEY_BLOCK_ENV, FP8_STAGED_V_MAX_ROWS, FP8_V_LAYOUT_ENV, Config
from jzyfa.primitives import FFI_TARGET, FFI_TARGET_VALUE_OPERAND, fp8_value_operand_p
from jzyfa.quantize import fp8_quantize

pytestmark = pytest.mark.usefixtures("cpu_backend")

F8 = E4M3 = jnp.float8_e4m3fn
ROWS = sorted(row for row in plan.KERNELS if row.family == "fp8")
DENSE_HEAD_DIMS = sorted({row.head_dims for row in ROWS if row.layout == "dense"})
# The head dims with a staged kernel (V transposed in the kernel): v's head dim 128.
STAGED_HEAD_DIMS = [dims for dims in DENSE_HEAD_DIMS if dims[1] == 128]
MASK_OPTIONS = {"none": {"causal": False}, "causal": {"causal": True}, "window": {"window": (8, 0)}}
DESCALE = jax.ShapeDtypeStruct((), jnp.float32)


def dims_id(dims) -> str:
    return f"{dims[0]}-{dims[1]}"


def row_id(row: Config) -> str:
    return f"{row.family}-{dims_id(row.head_dims)}-{row.mask}-{row.layout}"


@pytest.fixture
def kernel_available(monkeypatch):
    """The kernel faked available (this host has no GPU): what implementation=None sees on a Hopper GPU."""
    monkeypatch.setattr(_platform, "kernel_available", lambda: True)


def spec(shape, dtype=E4M3):
    return jax.ShapeDtypeStruct(shape, dtype)


def dense_specs(head_dims=(128, 128), *, batch=2, seq_q=300, seq_k=500, heads_q=8, heads_kv=2):
    qk, dv = head_dims
    return (
        spec((batch, seq_q, heads_q, qk)),
        spec((batch, seq_k, heads_kv, qk)),
        spec((batch, seq_k, heads_kv, dv)),
    )


def fp8_call(implementation=None, **kwargs):
    """flash_attention on e4m3 inputs taking the descales positionally."""

    def fn(q8, k8, v8, dq, dk, dv):
        return jzyfa.flash_attention(
            q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, implementation=implementation, **kwargs
        )

    return fn


def call_varlen(q, k, v, cu_q, cu_k, descales, *, max_q=64, max_k=64, **kwargs):
    dq, dk, dv = descales
    return jzyfa.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, descale_q=dq, descale_k=dk, descale_v=dv, **kwargs
    )


def row_call(row: Config, implementation):
    """(fn, *abstract args) of a call of this row's configuration."""
    options = dict(MASK_OPTIONS[row.mask], implementation=implementation)
    if row.layout == "dense":
        return (fp8_call(**options), *dense_specs(row.head_dims), DESCALE, DESCALE, DESCALE)
    qk, dv = row.head_dims
    cu = spec((5,), jnp.int32)

    def fn(q, k, v, cu_q, cu_k, *descales):
        return call_varlen(q, k, v, cu_q, cu_k, descales, max_q=200, max_k=260, **options)

    return (fn, spec((300, 8, qk)), spec((500, 2, qk)), spec((500, 2, dv)), cu, cu, DESCALE, DESCALE, DESCALE)


def kernel_calls(fn, *args) -> list[str]:
    return custom_call_lines(cuda_hlo(fn, *args), FFI_TARGET)


def kernel_call(fn, *args) -> str:
    (call,) = kernel_calls(fn, *args)
    return call


def attributes(call: str) -> dict[str, str]:
    """The custom call's attributes (its backend_config) as name -> text."""
    (config,) = re.findall(r"backend_config=\{(.*)\}", call)
    return dict(item.split(" = ", 1) for item in config.split(", "))


def operand_shapes(call: str) -> list[str]:
    operands = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", call).group(1)
    return re.findall(r"\w+\[[\d,]*\]", operands)


def bound_specs(fn, *args) -> list[primitives.AttentionSpec]:
    """The AttentionSpec of every attention_fwd_p the traced program binds (in nested jaxprs too)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive is primitives.attention_fwd_p:
                found.append(eqn.params["spec"])
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def path_of(fn, *args) -> plan.Path:
    specs = bound_specs(fn, *args)
    if not specs:
        return plan.Path.REFERENCE
    (spec_,) = specs
    return plan.Path.KERNEL_REQUIRED if spec_.kernel_required else plan.Path.PRIMITIVE


def fp8_spec(*, scale, causal, window=(-1, -1), lean_p=True, varlen=None, required=False):
    return primitives.make_spec(
        softmax_scale=scale, causal=causal, window=window, lean_p=lean_p, varlen=varlen, fp8=True,
        kernel_required=required,
    )  # fmt: skip


def primitive_call(**kwargs):
    """The primitive on (q8, k8, v8, descales) with an FP8 spec."""
    spec_ = fp8_spec(**kwargs)
    return lambda q, k, v, descales: primitives.attention_fwd(q, k, v, *descales, spec=spec_)


def fp8_qkv(
    rng, head_dims=(128, 128), *, batch=1, seq_q, seq_k=None, heads_q=4, heads_kv=2, granularity="tensor"
):
    """e4m3 q, k [.., qk] and v [.., dv] with their descales: ((q8, k8, v8), (dq, dk, dv))."""
    q, k, v = random_qkv(
        rng, batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dims[0],
        head_dim_v=head_dims[1], dtype=jnp.float32,
    )  # fmt: skip
    q8, dq = fp8_quantize(q, granularity, kv_heads=heads_kv if granularity == "head" else None)
    k8, dk = fp8_quantize(k, granularity)
    v8, dv = fp8_quantize(v, granularity)
    return (q8, k8, v8), (dq, dk, dv)


def assert_same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


# ---- which path, per implementation


@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_path_per_implementation(monkeypatch, row):
    """implementation="kernel": the required kernel; "xla": the pure-JAX path; None: the exact pure-JAX
    path on a CPU backend (FP8 calls do not bind the primitive there), the primitive where the kernel is
    available."""
    assert path_of(*row_call(row, "kernel")) is plan.Path.KERNEL_REQUIRED
    assert path_of(*row_call(row, "xla")) is plan.Path.REFERENCE
    assert path_of(*row_call(row, None)) is plan.Path.REFERENCE
    assert kernel_calls(*row_call(row, None)) == []
    monkeypatch.setattr(_platform, "kernel_available", lambda: True)
    assert path_of(*row_call(row, None)) is plan.Path.PRIMITIVE
    assert len(kernel_calls(*row_call(row, None))) == 1
    fn, *args = row_call(row, "kernel")
    with pytest.raises(ValueError, match="implementation='kernel' needs a Hopper GPU.*non-CUDA platform"):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",))


def test_a_required_kernel_refuses_to_run_on_the_cpu(rng):
    (q8, k8, v8), descales = fp8_qkv(rng, seq_q=16, heads_q=2, heads_kv=2)
    for options in ({"causal": True}, {"window": (8, 0)}):
        with pytest.raises(ValueError, match="non-CUDA platform"):
            fp8_call("kernel", **options)(q8, k8, v8, *descales)
    (q8, k8, v8), descales, cu_q, cu_k = random_fp8_packed(rng, [7, 0, 12], [7, 3, 12])
    with pytest.raises(ValueError, match="non-CUDA platform"):
        call_varlen(q8, k8, v8, cu_q, cu_k, descales, max_q=12, max_k=12, implementation="kernel")


# ---- configurations outside the table: the reason, and the pure-JAX path

OUTSIDE_DENSE = [
    ((96, 96), "causal"),
    ((192, 192), "causal"),
    ((192, 64), "none"),
    ((128, 64), "causal"),
    ((64, 128), "none"),
    ((128, 192), "causal"),
    ((256, 128), "none"),
    ((128, 256), "causal"),
    ((192, 128), "window"),  # MLA has no windowed FP8 instantiation
]


@pytest.mark.parametrize(
    "head_dims, mask", OUTSIDE_DENSE, ids=lambda x: dims_id(x) if isinstance(x, tuple) else x
)
def test_dense_configurations_outside_the_table_say_why(rng, kernel_available, head_dims, mask):
    config = Config("fp8", head_dims, mask, "dense")
    assert config not in plan.KERNELS
    problem = plan.config_problem(config)
    fn, *args = row_call(config, "kernel")
    with pytest.raises(
        ValueError, match="^" + re.escape(f"implementation='kernel' cannot serve this call: {problem}")
    ):
        jax.eval_shape(fn, *args)
    fn, *args = row_call(config, None)
    assert path_of(fn, *args) is plan.Path.REFERENCE  # even where a kernel runs
    assert kernel_calls(fn, *args) == []
    (q8, k8, v8), descales = fp8_qkv(rng, head_dims, seq_q=40, seq_k=72)
    out = fn(q8, k8, v8, *descales)
    assert out.shape == (1, 40, 4, head_dims[1]) and out.dtype == jnp.bfloat16


def test_fp8_problem_sentences():
    assert plan.config_problem(Config("fp8", (96, 96), "causal", "dense")) == (
        "the FP8 (e4m3) kernels take head dims (q and k / v) 64/64, 128/128, 192/128, 256/256, got 96/96"
    )
    assert plan.config_problem(Config("fp8", (192, 128), "window", "dense")) == (
        "the FP8 (e4m3) kernel at head dims 192/128 (dense) takes masks none, causal, not a 'window' mask"
    )


@pytest.mark.parametrize("causal, window", [(False, (8, 0)), (True, (16, 4)), (False, (-1, 5))])
def test_mla_sliding_windows_stay_on_the_pure_jax_path_with_a_reason(rng, kernel_available, causal, window):
    (q8, k8, v8), descales = fp8_qkv(rng, (192, 128), seq_q=40, seq_k=72)
    fn = fp8_call(causal=causal, window=window)
    assert path_of(fn, q8, k8, v8, *descales) is plan.Path.REFERENCE
    with pytest.raises(
        ValueError,
        match=r"cannot serve this call: .*192/128 \(dense\) takes masks none, causal, not a 'window' mask",
    ):
        fp8_call("kernel", causal=causal, window=window)(q8, k8, v8, *descales)
    out = fn(q8, k8, v8, *descales)
    assert out.shape == (1, 40, 4, 128)


def test_varlen_fp8_outside_head_dims_64_128_256_is_refused_with_a_reason(rng):
    """flash_attention_varlen has FP8 at head dims 64, 128 and 256 only (not MLA's 192/128): refused
    whatever the implementation."""
    (q8, k8, v8), (dq, dk, dv) = fp8_qkv(rng, (192, 128), seq_q=40, seq_k=40, heads_q=2, heads_kv=2)
    cu = jnp.asarray([0, 15, 40], jnp.int32)
    message = r"FP8 inputs with one head_dim of 64, 128 or 256 for q, k and v, got 192 \(q, k\) and 128 \(v\)"
    for implementation in (None, "kernel"):
        with pytest.raises(ValueError, match=message):
            jzyfa.flash_attention_varlen(
                q8[0], k8[0], v8[0], cu, cu, 25, 25, descale_q=dq, descale_k=dk, descale_v=dv,
                implementation=implementation,
            )  # fmt: skip
    assert Config("fp8", (192, 128), "causal", "varlen") not in plan.KERNELS


def test_window_token_limit_is_named():
    q = spec((1, 1024, 1, 128))
    k = spec((1, 1 << 30, 1, 128))
    with pytest.raises(
        ValueError, match=r"cannot serve this call: the kernels' sliding windows take seq_q \+ seq_k <= 2\^30"
    ):
        jax.eval_shape(fp8_call("kernel", window=(8, 0)), q, k, k, DESCALE, DESCALE, DESCALE)
    assert (
        path_of(fp8_call("kernel", causal=True), q, k, k, DESCALE, DESCALE, DESCALE)
        is plan.Path.KERNEL_REQUIRED
    )


@pytest.mark.parametrize("window", [(-2, 0), (3, -5)])
def test_bad_windows_name_the_argument(rng, window):
    (q8, k8, v8), descales = fp8_qkv(rng, seq_q=16, heads_q=2, heads_kv=2)
    with pytest.raises(ValueError, match="window"):
        fp8_call("kernel", window=window)(q8, k8, v8, *descales)


# ---- the dense custom call


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lean_p", [True, False])
@pytest.mark.parametrize("head_dims", STAGED_HEAD_DIMS, ids=dims_id)
def test_dense_custom_call_with_v_staged(monkeypatch, head_dims, causal, lean_p):
    """V staged (JZYFA_FP8_V_LAYOUT=staged): one custom call on V as it is (the kernel transposes V's
    tiles itself): q and k qk wide, v and out dv, GQA heads, Sq != Sk; lse [B, Hq, Sq], the tile counter;
    per (batch, KV head) descales flattened to [B * Hkv]; no window; the default scale 1/sqrt(qk)."""
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "staged")
    qk, dv = head_dims
    hlo = cuda_hlo(
        fp8_call("kernel", causal=causal, lean_p=lean_p, return_lse=True),
        *dense_specs(head_dims),
        DESCALE,
        DESCALE,
        DESCALE,
    )
    (call,) = custom_call_lines(hlo, FFI_TARGET)
    assert len(re.findall(r"custom-call\(", hlo)) == 1  # no V layout pass before it
    assert "api_version=API_VERSION_TYPED_FFI" in call
    assert f"(bf16[2,300,8,{dv}]{{3,2,1,0}}, f32[2,8,300]{{2,1,0}}, s32[1]{{0}}) custom-call(" in call
    assert operand_shapes(call) == [
        f"f8e4m3fn[2,300,8,{qk}]", f"f8e4m3fn[2,500,2,{qk}]", f"f8e4m3fn[2,500,2,{dv}]", "f32[4]", "f32[4]", "f32[4]",
    ]  # fmt: skip
    attrs = attributes(call)
    assert attrs["causal"] == str(causal).lower() and attrs["lean_p"] == str(lean_p).lower()
    assert attrs["window_left"] == attrs["window_right"] == "-1 : i64"
    assert attrs["v_transposed"] == "false" and attrs["varlen"] == "false" and attrs["key_block"] == "0 : i64"
    assert attrs["max_seqlen_q"] == attrs["max_seqlen_k"] == "0 : i64"
    assert np.float32(attrs["softmax_scale"].split(" : ")[0]) == np.float32(1 / np.sqrt(qk))


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("layout", ["staged", "transposed", ""])
def test_head_dims_64_and_256_are_always_v_transposed(monkeypatch, layout, head_dim):
    """The staged kernel transposes 128-byte V rows only: at head dims 64 and 256 the call takes V^T
    from the layout kernel whatever the rule or the override says."""
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, layout)
    dims = (head_dim, head_dim)
    add_rows(monkeypatch, "fp8", dims)  # the lowering of a built kernel, planned or not yet
    hlo = cuda_hlo(fp8_call("kernel", causal=True), *dense_specs(dims), DESCALE, DESCALE, DESCALE)
    (call,) = custom_call_lines(hlo, FFI_TARGET)
    assert attributes(call)["v_transposed"] == "true"
    (layout_call,) = custom_call_lines(hlo, FFI_TARGET_VALUE_OPERAND)
    assert f"f8e4m3fn[2,2,{head_dim},512]" in layout_call


def test_dense_custom_call_takes_per_head_descales_and_the_given_scale(rng, monkeypatch):
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "staged")
    (q8, k8, v8), descales = fp8_qkv(
        rng, batch=2, seq_q=40, seq_k=70, heads_q=4, heads_kv=2, granularity="head"
    )
    fn = primitive_call(scale=0.125, causal=True, lean_p=False, required=True)
    call = kernel_call(fn, q8, k8, v8, descales)
    assert call.count("f32[4]{0}") == 3  # per (batch, KV head) descales, flattened
    assert "causal = true" in call and "lean_p = false" in call and "v_transposed = false" in call
    assert re.search(r"softmax_scale = 1.250*e-01 : f32", call)


DENSE_WINDOWS = [
    (False, None, "false", (-1, -1)),
    (True, None, "true", (-1, -1)),
    (False, (128, 0), "false", (128, 0)),
    (False, (0, 0), "false", (0, 0)),
    (False, (37, 5), "false", (37, 5)),
    (False, (-1, 64), "false", (-1, 64)),
    (True, (127, 5), "false", (127, 0)),  # causal sets the right bound to 0
    (True, (-1, 3), "true", (-1, -1)),
    (False, (8192, 0), "true", (-1, -1)),  # the whole prefix: the plain causal kernel
    (False, (499, 299), "false", (-1, -1)),  # bounds that exclude no key: no mask
    (False, (497, 298), "false", (497, 298)),
]


@pytest.mark.parametrize("causal, window, want_causal, want_window", DENSE_WINDOWS)
@pytest.mark.parametrize("implementation", [None, "kernel"])
def test_dense_custom_call_carries_the_canonical_window(
    kernel_available, implementation, causal, window, want_causal, want_window
):
    call = kernel_call(
        fp8_call(implementation, causal=causal, window=window), *dense_specs(), DESCALE, DESCALE, DESCALE
    )
    assert f"causal = {want_causal}" in call
    assert window_attributes(call) == want_window
    assert "lean_p = true" in call


@pytest.mark.parametrize(
    "causal, window", [(False, (8192, 0)), (True, (-1, 3)), (False, (499, 299)), (False, None)]
)
def test_mla_windows_that_come_down_to_causal_or_none_reach_the_kernel(causal, window):
    call = kernel_call(
        fp8_call("kernel", causal=causal, window=window), *dense_specs((192, 128)), DESCALE, DESCALE, DESCALE
    )
    assert window_attributes(call) == (-1, -1)


# ---- V's operand layout and the key block


def lower_fp8_for_cuda(batch, seq_q, seq_k, heads_q, heads_kv, head_dim=128, causal=True, window=None):
    """The FP8 kernel path's HLO for CUDA from shapes alone (no arrays), per-head descales."""
    q = spec((batch, seq_q, heads_q, head_dim))
    k = spec((batch, seq_k, heads_kv, head_dim))
    v = spec((batch, seq_k, heads_kv, 128))
    d = spec((batch, heads_kv), jnp.float32)
    fn = fp8_call("kernel", causal=causal, window=window, softmax_scale=0.125)
    return cuda_hlo(fn, q, k, v, d, d, d)


def assert_staged(hlo, v_shape):
    """One custom call, the FP8 kernel's, on V as it is (v_transposed = false)."""
    (call,) = [line for line in hlo.splitlines() if "custom-call(" in line]
    assert f'custom_call_target="{FFI_TARGET}"' in call, call
    assert "v_transposed = false" in call
    assert f"f8e4m3fn[{v_shape}]{{3,2,1,0}}, f32[" in call, call  # v's operand constraint, as it is
    return call


def assert_transposed(hlo, vt_shape):
    """The layout kernel's call on V, then the FP8 kernel's on its result (v_transposed = true)."""
    (layout,) = custom_call_lines(hlo, FFI_TARGET_VALUE_OPERAND)
    (call,) = custom_call_lines(hlo, FFI_TARGET)
    assert sum("custom-call(" in line for line in hlo.splitlines()) == 2, hlo
    assert f"f8e4m3fn[{vt_shape}]{{3,2,1,0}} custom-call(" in layout, layout
    operands = call.split("custom-call(")[1].split(")")[0].split(", ")
    assert operands[2] == layout.split("=")[0].strip()  # vt is the layout call's result
    assert "v_transposed = true" in call
    assert "gather" not in hlo  # no XLA permutation of V left
    return call


@pytest.fixture
def key_block_rule(monkeypatch):
    """_extension.fp8_key_block replaced by the kernel's key-block rule as tests/test_extension.py pins it
    on the built extension (192-key blocks for head dim 128 with V^T, no window, from WIDE_MIN_KEYS),
    so that the layout rule's tests do not depend on whether this machine built the extension; yields
    the calls it answered."""
    calls = []

    def fp8_key_block(*, v_transposed, head_dim, causal, window, seq_q, seq_k):
        del seq_q  # the rule reads the keys a row sees
        calls.append(
            {
                "v_transposed": v_transposed,
                "head_dim": head_dim,
                "causal": causal,
                "window": window,
                "seq_k": seq_k,
            }
        )
        wide = v_transposed and head_dim == 128 and window[0] == -1 and seq_k >= WIDE_MIN_KEYS[causal]
        return 192 if wide else 128

    monkeypatch.setattr(plan._extension, "fp8_key_block", fp8_key_block)
    yield calls


def layout_of(seq_q, seq_k, heads_q, heads_kv, head_dim=128, causal=True):
    """fp8_value_layout for a call of these shapes, the window as the primitive holds it."""
    window = (-1, 0) if causal else (-1, -1)
    return plan.fp8_value_layout(
        seq_q, heads_q, heads_kv, seq_k=seq_k, head_dim=head_dim, causal=causal, window=window
    )


@pytest.mark.parametrize(
    "batch, seq_q, seq_k, heads_q, heads_kv, layout",
    [
        (16, 1024, 1024, 16, 16, "staged"),  # 1024 rows per KV head
        (1, 1024, 1024, 16, 8, "staged"),  # GQA: 2048 rows, the threshold
        (1, 1025, 1024, 16, 8, "transposed"),  # 2050 rows
        (4, 4096, 4096, 16, 16, "transposed"),
        (1, 16384, 16384, 16, 16, "transposed"),
        (1, 512, 16384, 32, 4, "transposed"),  # short q, 8 query heads per KV head: 4096 rows
        # 2048 rows, but they see enough keys for 192-key blocks, which only the V^T kernel has:
        (1, 512, 16384, 32, 8, "transposed"),  # a prefill chunk against a long cache
        (2, 2048, 8192, 16, 16, "transposed"),
        (2, 2048, 3072, 16, 16, "transposed"),
        (2, 2048, 3071, 16, 16, "staged"),  # 128-key blocks in either layout
    ],
)
def test_v_layout_follows_rows_per_kv_head_and_keys(
    key_block_rule, batch, seq_q, seq_k, heads_q, heads_kv, layout
):
    """Staged up to FP8_STAGED_V_MAX_ROWS rows per KV head unless the kernel given V^T would run 192-key
    blocks."""
    assert layout_of(seq_q, seq_k, heads_q, heads_kv) == layout
    few_rows = seq_q * (heads_q // heads_kv) <= FP8_STAGED_V_MAX_ROWS
    assert (few_rows and seq_k < WIDE_MIN_KEYS[True]) == (layout == "staged")
    if layout == "transposed" and few_rows:  # the extension was asked about the V^T kernel for this call
        asked = {"v_transposed": True, "head_dim": 128, "causal": True, "window": (-1, 0), "seq_k": seq_k}
        assert key_block_rule[-1] == asked
    hlo = lower_fp8_for_cuda(batch, seq_q, seq_k, heads_q, heads_kv)
    if layout == "staged":
        call = assert_staged(hlo, f"{batch},{seq_k},{heads_kv},128")
    else:
        call = assert_transposed(hlo, f"{batch},{heads_kv},128,{-(-seq_k // 32) * 32}")
    assert "key_block = 0 : i64" in call  # no override: the launch's rule
    # The emulation's blocks follow the kernel's (jzyfa.plan.fp8_key_block).
    q_shape, k_shape = (batch, seq_q, heads_q, 128), (batch, seq_k, heads_kv, 128)
    wide = layout == "transposed" and seq_k >= WIDE_MIN_KEYS[True]
    assert plan.fp8_key_block(q_shape, k_shape, causal=True) == (192 if wide else 128)


@pytest.mark.parametrize("seq_k, layout", [(1535, "staged"), (1536, "transposed")])
def test_v_layout_without_a_mask_takes_its_own_key_threshold(key_block_rule, seq_k, layout):
    assert layout_of(1024, seq_k, 16, 16, causal=False) == layout
    hlo = lower_fp8_for_cuda(1, 1024, seq_k, 16, 16, causal=False)
    if layout == "staged":
        assert_staged(hlo, f"1,{seq_k},16,128")
    else:
        assert_transposed(hlo, f"1,16,128,{-(-seq_k // 32) * 32}")


def test_v_layout_stays_staged_where_no_192_key_kernel_exists(key_block_rule):
    """Few rows that see many keys, but MLA's head dims or a sliding window: the V^T kernel would run
    128-key blocks too, so V stays as it is."""
    assert layout_of(512, 16384, 16, 16, head_dim=192) == "staged"
    assert key_block_rule[-1]["head_dim"] == 192  # asked, and the answer was 128
    window = (1023, 0)
    assert (
        plan.fp8_value_layout(512, 16, 16, seq_k=16384, head_dim=128, causal=True, window=window) == "staged"
    )
    assert_staged(lower_fp8_for_cuda(1, 512, 16384, 16, 16, head_dim=192), "1,16384,16,128")
    assert_staged(lower_fp8_for_cuda(1, 512, 16384, 16, 16, window=(1023, 0)), "1,16384,16,128")


def test_v_layout_env_overrides_the_rule(monkeypatch):
    short, long = (2, 100, 70, 4, 2), (1, 8192, 8192, 8, 8)
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "transposed")
    assert_transposed(lower_fp8_for_cuda(*short), "2,2,128,96")
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "staged")
    assert_staged(lower_fp8_for_cuda(*long), "1,8192,8,128")
    # MLA's q/k 192 too: vt's rows are v's head dim (128).
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "transposed")
    assert_transposed(lower_fp8_for_cuda(1, 64, 100, 2, 2, head_dim=192), "1,2,128,128")


def test_v_layout_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "vt")
    with pytest.raises(ValueError, match=f"{FP8_V_LAYOUT_ENV} must be one of staged, transposed"):
        lower_fp8_for_cuda(1, 64, 64, 2, 2)


@pytest.mark.parametrize("value, attribute", [("auto", 0), ("128", 128), ("192", 192), ("", 0)])
def test_key_block_env_is_the_key_block_attribute(monkeypatch, value, attribute):
    """JZYFA_FP8_KEY_BLOCK, read at trace time, is the key_block attribute of dense head-dim-128
    unwindowed calls with V^T from memory; 0 (the launch's rule) for every other call."""
    monkeypatch.setenv(FP8_KEY_BLOCK_ENV, value)
    call = assert_transposed(lower_fp8_for_cuda(1, 8192, 8192, 8, 8), "1,8,128,8192")
    assert f"key_block = {attribute} : i64" in call
    call = assert_transposed(lower_fp8_for_cuda(1, 8192, 8192, 8, 8, causal=False), "1,8,128,8192")
    assert f"key_block = {attribute} : i64" in call
    assert plan.fp8_key_block((1, 8192, 8, 128), (1, 8192, 8, 128), causal=True) == (
        attribute
        or plan.fp8_key_block_for(
            v_transposed=True, head_dim=128, causal=True, window=(-1, 0), seq_q=8192, seq_k=8192
        )
    )
    # A short call stages V unless 192-key blocks are forced, which only the V^T kernel has.
    short = lower_fp8_for_cuda(1, 64, 64, 2, 2)
    if attribute == 192:
        assert "key_block = 192 : i64" in assert_transposed(short, "1,2,128,64")
    else:
        assert "key_block = 0 : i64" in assert_staged(short, "1,64,2,128")
    # Staged V, a window, MLA's head dims: the launch's rule.
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "staged")
    assert "key_block = 0 : i64" in assert_staged(lower_fp8_for_cuda(1, 8192, 8192, 8, 8), "1,8192,8,128")
    monkeypatch.delenv(FP8_V_LAYOUT_ENV)
    for hlo in (
        lower_fp8_for_cuda(1, 8192, 8192, 8, 8, window=(1024, 0)),
        lower_fp8_for_cuda(1, 8192, 8192, 8, 8, head_dim=192),
    ):
        assert "key_block = 0 : i64" in kernel_call_of(hlo)


def kernel_call_of(hlo: str) -> str:
    (call,) = custom_call_lines(hlo, FFI_TARGET)
    return call


def test_key_block_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv(FP8_KEY_BLOCK_ENV, "256")
    with pytest.raises(ValueError, match=f"{FP8_KEY_BLOCK_ENV} must be one of auto, 128, 192"):
        lower_fp8_for_cuda(1, 8192, 8192, 8, 8)


# ---- the dense primitive's CPU lowering: the kernel's emulation

DENSE_CASES = [
    (2, 40, 40, 4, 2, True, "tensor"),
    (1, 30, 75, 2, 1, True, "head"),  # Sk > Sq and not a multiple of 32: a partial V tile
    (1, 90, 20, 2, 2, True, "tensor"),  # Sq > Sk: the first rows see no key
    (1, 33, 130, 4, 1, False, "head"),
]


@pytest.mark.parametrize("lean_p", [True, False])
@pytest.mark.parametrize("batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity", DENSE_CASES)
@pytest.mark.parametrize("head_dims", DENSE_HEAD_DIMS, ids=dims_id)
def test_primitive_off_cuda_is_the_emulation(
    rng, head_dims, lean_p, batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity
):
    (q8, k8, v8), descales = fp8_qkv(
        rng,
        head_dims,
        batch=batch,
        seq_q=seq_q,
        seq_k=seq_k,
        heads_q=heads_q,
        heads_kv=heads_kv,
        granularity=granularity,
    )
    scale = head_dims[0] ** -0.5
    out, lse = jax.jit(primitive_call(scale=scale, causal=causal, lean_p=lean_p))(q8, k8, v8, descales)
    want_out, want_lse = attention_fp8_emulated(
        q8, k8, v8, *descales, causal=causal, softmax_scale=scale, lean_p=lean_p, integer_reference=True
    )
    assert out.dtype == jnp.bfloat16 and out.shape == (batch, seq_q, heads_q, head_dims[1])
    assert lse.shape == (batch, heads_q, seq_q)
    assert_same((out, lse), (want_out, want_lse))
    if causal and seq_q > seq_k:
        assert np.all(np.isneginf(np.asarray(lse)[:, :, : seq_q - seq_k]))


@pytest.mark.parametrize("lean_p", [True, False])
@pytest.mark.parametrize(
    "seq_q, seq_k, causal, window",
    [
        (40, 300, False, (37, 5)),
        (300, 300, False, (128, 0)),  # two key blocks, a window of one block
        (90, 20, False, (0, 0)),  # Sq > Sk: the first rows see no key
        (33, 260, False, (-1, 64)),
        (64, 64, True, (10, 7)),  # causal sets the right bound to 0
    ],
)
def test_primitive_off_cuda_is_the_emulation_with_the_window(rng, lean_p, seq_q, seq_k, causal, window):
    (q8, k8, v8), descales = fp8_qkv(rng, seq_q=seq_q, seq_k=seq_k, heads_q=4, heads_kv=2, granularity="head")
    scale = 128**-0.5
    out, lse = jax.jit(primitive_call(scale=scale, causal=causal, window=window, lean_p=lean_p))(
        q8, k8, v8, descales
    )
    want_out, want_lse = attention_fp8_emulated(
        q8,
        k8,
        v8,
        *descales,
        causal=causal,
        window=window,
        softmax_scale=scale,
        lean_p=lean_p,
        integer_reference=True,
    )
    assert_same((out, lse), (want_out, want_lse))
    if seq_q > seq_k:
        assert np.isneginf(np.asarray(lse)).any()  # rows left of every key: LSE = -inf


@pytest.mark.parametrize("head_dims", DENSE_HEAD_DIMS, ids=dims_id)
def test_both_v_layouts_are_the_emulation_off_cuda(rng, fp8_v_layout, head_dims):
    """Off CUDA the transposed layout round-trips V through fp8_value_operand: the same result."""
    (q8, k8, v8), descales = fp8_qkv(rng, head_dims, seq_q=30, seq_k=75, heads_q=2, heads_kv=1)
    scale = 0.125
    spec_ = fp8_spec(scale=scale, causal=True)
    hlo = (
        jax.jit(lambda *a: primitives.attention_fwd(*a, spec=spec_))
        .trace(q8, k8, v8, *descales)
        .lower(lowering_platforms=("cuda",))
        .as_text(dialect="hlo")
    )
    transposed = fp8_v_layout == "transposed" or head_dims in ((64, 64), (256, 256))  # no staged kernel
    assert f"v_transposed = {str(transposed).lower()}" in kernel_call_of(hlo)
    out, lse = primitive_call(scale=scale, causal=True)(q8, k8, v8, descales)
    want = attention_fp8_emulated(
        q8, k8, v8, *descales, causal=True, softmax_scale=scale, lean_p=True, integer_reference=True
    )
    assert_same((out, lse), want)


def test_mixed_descale_shapes_broadcast_to_per_head(rng):
    (q8, k8, v8), (dq, dk, dv) = fp8_qkv(rng, batch=2, seq_q=16, heads_q=2, heads_kv=2, granularity="head")
    mixed = (dq, jnp.float32(dk.max()), dv)
    out, _ = primitive_call(scale=0.1, causal=True)(q8, k8, v8, mixed)
    want, _ = attention_fp8_emulated(
        q8, k8, v8, *mixed, causal=True, softmax_scale=0.1, integer_reference=True
    )
    assert_same((out,), (want,))


def test_api_where_the_kernel_runs_is_the_emulation(rng, kernel_available):
    """implementation=None where the kernel is available binds the primitive; on a CPU its lowering is
    the emulation."""
    (q8, k8, v8), descales = fp8_qkv(rng, seq_q=40, seq_k=72, granularity="head")
    fn = fp8_call(window=(8, 0), return_lse=True)
    assert path_of(fn, q8, k8, v8, *descales) is plan.Path.PRIMITIVE
    got = jax.jit(fn)(q8, k8, v8, *descales)
    want = attention_fp8_emulated(
        q8, k8, v8, *descales, causal=False, window=(8, 0), softmax_scale=128**-0.5, integer_reference=True
    )
    assert_same(got, want)


# ---- vmap, abstract evals, sharding


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_vmap_folds_into_the_batch(rng, granularity):
    """vmap over a leading axis (per-element descales too) equals a loop over it."""
    sets = [
        fp8_qkv(rng, batch=2, seq_q=24, seq_k=40, heads_q=2, heads_kv=1, granularity=granularity)
        for _ in range(3)
    ]
    stack = lambda i: jnp.stack([s[0][i] for s in sets])
    stack_d = lambda i: jnp.stack([s[1][i] for s in sets])
    call = primitive_call(scale=0.1, causal=True)
    out, lse = jax.vmap(lambda q, k, v, dq, dk, dv: call(q, k, v, (dq, dk, dv)))(
        stack(0), stack(1), stack(2), stack_d(0), stack_d(1), stack_d(2)
    )
    for i, ((q8, k8, v8), descales) in enumerate(sets):
        want_out, want_lse = call(q8, k8, v8, descales)
        assert_same((out[i], lse[i]), (want_out, want_lse))


def test_vmap_with_shared_descales_and_unmapped_kv(rng):
    (q8, k8, v8), descales = fp8_qkv(rng, seq_q=16, seq_k=32, heads_q=2, heads_kv=2)
    qs = jnp.stack([q8, q8[:, ::-1]])
    call = primitive_call(scale=0.1, causal=False, lean_p=False)
    out, _ = jax.vmap(lambda q: call(q, k8, v8, descales))(qs)
    for i in range(2):
        want, _ = call(qs[i], k8, v8, descales)
        assert_same((out[i],), (want,))


def test_vmap_keeps_the_window():
    fn = jax.vmap(fp8_call("kernel", window=(16, 4)), in_axes=(0, 0, 0, None, None, None))
    q, k, v = (jax.ShapeDtypeStruct((3,) + x.shape, F8) for x in dense_specs())
    call = kernel_call(fn, q, k, v, DESCALE, DESCALE, DESCALE)
    assert window_attributes(call) == (16, 4)


@pytest.mark.parametrize(
    "layout, v_shape", [("staged", "f8e4m3fn[6,500,2,128]"), ("transposed", "f8e4m3fn[6,2,128,512]")]
)
def test_abstract_evals_and_vmap_keep_v_head_dim(monkeypatch, layout, v_shape):
    """out takes v's head dim in the primitive's and the per-shard primitive's abstract evals (from V^T's
    rows where v is V^T); vmap folds into one call."""
    Q, K, V = dense_specs((192, 128))
    out, lse = jax.eval_shape(fp8_call(causal=True, return_lse=True), Q, K, V, DESCALE, DESCALE, DESCALE)
    assert (out.shape, out.dtype, lse.shape) == ((2, 300, 8, 128), jnp.bfloat16, (2, 8, 300))
    d = spec((4,), jnp.float32)
    base = fp8_spec(scale=0.1, causal=True)
    vt = spec((2, 2, 128, 512))
    for v, v_transposed in ((V, False), (vt, True)):
        shard_spec = primitives.AttentionSpec(**{**base.__dict__, "v_transposed": v_transposed})
        avals = [jax.core.ShapedArray(x.shape, x.dtype) for x in (Q, K, v, d, d, d)]
        shard_out, shard_lse = primitives.attention_fwd_shard_p.abstract_eval(*avals, spec=shard_spec)[0]
        assert shard_out.shape == (2, 300, 8, 128) and shard_lse.shape == (2, 8, 300)
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, layout)
    jax.clear_caches()  # the layout is read when the call is traced
    stacked = [jax.ShapeDtypeStruct((3,) + x.shape, x.dtype) for x in (Q, K, V)]
    vmapped = jax.vmap(fp8_call("kernel", causal=True), in_axes=(0, 0, 0, None, None, None))
    call = kernel_call(vmapped, *stacked, DESCALE, DESCALE, DESCALE)
    # v as it is, or V^T from the layout kernel: v's head dim 128 either way.
    for shape in ("bf16[6,300,8,128]", "f8e4m3fn[6,500,2,192]", v_shape):
        assert shape in call, (layout, shape)


def test_head_sharding_keeps_the_window(rng):
    """Under a sharded jit (CPU devices: the emulation lowering) the window reaches every shard."""
    mesh = cpu_mesh((4,), ("model",))
    (q8, k8, v8), descales = fp8_qkv(
        rng, batch=2, seq_q=64, seq_k=200, heads_q=4, heads_kv=4, granularity="head"
    )
    fn = primitive_call(scale=0.1, causal=False, window=(20, 3))
    heads = NamedSharding(mesh, P(None, None, "model"))
    per_head = NamedSharding(mesh, P(None, "model"))
    sharded = jax.jit(lambda q, k, v, d: fn(q, k, v, d), in_shardings=(heads, heads, heads, [per_head] * 3))
    got = sharded(q8, k8, v8, list(descales))
    want = jax.jit(fn)(q8, k8, v8, descales)
    assert_same(got, want)


# ---- varlen: argument checks and the pure-JAX path

SCALAR = spec((), jnp.float32)
GOOD = {"q": spec((10, 4, 128)), "k": spec((12, 2, 128)), "v": spec((12, 2, 128))}
CU = spec((3,), jnp.int32)


@pytest.mark.parametrize(
    "replace, descales, error, message",
    [
        ({}, (SCALAR, None, SCALAR), ValueError, "FP8 inputs need descale_q, descale_k and descale_v; missing descale_k"),
        ({}, (SCALAR, spec((2, 2), jnp.float32), spec((3, 2), jnp.float32)), ValueError,
         r"descale_v must have shape \(\), \(1,\) or \[num_seqs, kv_heads\] = \[2, 2\], got \(3, 2\)"),
        ({}, (SCALAR, SCALAR, spec((), jnp.bfloat16)), TypeError, "descale_v must be float32, got bfloat16"),
        ({n: spec(GOOD[n].shape, jnp.bfloat16) for n in "qkv"}, (SCALAR, None, None), ValueError,
         "descale_q given for bfloat16 inputs; descales apply only to FP8 inputs"),
        ({n: spec(GOOD[n].shape[:2] + (96,)) for n in "qkv"}, (SCALAR,) * 3, ValueError,
         r"FP8 inputs with one head_dim of 64, 128 or 256 for q, k and v, got 96 \(q, k\) and 96 \(v\)"),
        ({"v": spec((12, 2, 128), jnp.bfloat16)}, (SCALAR,) * 3, TypeError, "q, k and v must share a dtype"),
    ],
)  # fmt: skip
def test_bad_varlen_calls_raise(replace, descales, error, message):
    args = {**GOOD, **replace}
    descales = [None if d is None else jnp.zeros(d.shape, d.dtype) for d in descales]
    q, k, v = (jnp.zeros(args[n].shape, args[n].dtype) for n in "qkv")
    cu = jnp.asarray([0, 4, 10], jnp.int32)
    with pytest.raises(error, match=message):
        call_varlen(q, k, v, cu, jnp.asarray([0, 5, 12], jnp.int32), descales, max_q=6, max_k=7)


def dense_fp8_per_sequence(q8, k8, v8, descales, cu_q, cu_k, *, causal):
    """Each sequence alone through dense FP8 `flash_attention` (pure-JAX path): (out, lse) packed."""
    out = np.zeros(q8.shape, np.float32)
    lse = np.full((q8.shape[1], q8.shape[0]), -np.inf, np.float32)
    for s in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if cu_q[s + 1] == cu_q[s] or cu_k[s + 1] == cu_k[s]:
            continue  # no query, or no key: out = 0, lse = -inf
        ds = [d if d.ndim < 2 else d[s : s + 1] for d in descales]
        o, l = jzyfa.flash_attention(
            q8[None, rows], k8[None, keys], v8[None, keys], causal=causal, return_lse=True,
            implementation="xla", descale_q=ds[0], descale_k=ds[1], descale_v=ds[2],
        )  # fmt: skip
        out[rows], lse[:, rows] = np.asarray(o[0], np.float32), np.asarray(l[0])
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_varlen_pure_jax_path_is_dense_fp8_per_sequence(rng, causal, per_head):
    """Unequal lengths, a sequence with no query, one with queries but no key, tokens past the end."""
    lengths_q, lengths_k = [5, 0, 17, 3, 40], [9, 4, 30, 0, 33]
    (q8, k8, v8), descales, cu_q, cu_k = random_fp8_packed(
        rng, lengths_q, lengths_k, pad_q=3, per_head=per_head
    )
    fn = jax.jit(functools.partial(call_varlen, max_q=40, max_k=33, causal=causal, return_lse=True))
    out, lse = fn(q8, k8, v8, cu_q, cu_k, descales)
    assert out.dtype == jnp.bfloat16 and out.shape == q8.shape and lse.shape == (4, q8.shape[0])
    want_out, want_lse = dense_fp8_per_sequence(q8, k8, v8, descales, cu_q, cu_k, causal=causal)
    # The same float32 attention, summed in another order: bf16 outputs may differ by one rounding.
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, rtol=2**-7, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6, atol=1e-6)
    # And against float64 on the dequantized values (out is bf16).
    f64 = [dequantized_f64(x, d, cu) for x, d, cu in zip((q8, k8, v8), descales, (cu_q, cu_k, cu_k))]
    ref_out, ref_lse = naive_varlen_f64(*f64, cu_q, cu_k, causal=causal)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref_out, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-4, rtol=1e-5)


def test_varlen_sliding_window_pure_jax_path(rng):
    lengths = [50, 1, 70]
    (q8, k8, v8), descales, cu_q, cu_k = random_fp8_packed(rng, lengths, lengths, per_head=True)
    out = call_varlen(q8, k8, v8, cu_q, cu_k, descales, max_q=70, max_k=70, window=(8, 2))
    f64 = [dequantized_f64(x, d, cu) for x, d, cu in zip((q8, k8, v8), descales, (cu_q, cu_k, cu_k))]
    ref, _ = naive_varlen_f64(*f64, cu_q, cu_k, causal=False, window=(8, 2))
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=2e-2, rtol=2e-2)


# ---- the varlen V^T layout


def value_operand_np(v: np.ndarray, cu_k: np.ndarray) -> np.ndarray:
    """The varlen V^T built key by key: sequence s's key j at column roundup32(cu_k[s]) + 32 s + the
    column of j in its permuted group; zeros elsewhere."""
    total_k, heads_kv, head_dim = v.shape
    num_seqs = len(cu_k) - 1
    vt = np.zeros((heads_kv, head_dim, varlen_padded_keys(total_k, num_seqs)), v.dtype)
    column_of = np.argsort(KEY_PERMUTATION)  # column k of a group holds key KEY_PERMUTATION[k]
    for s in range(num_seqs):
        start = -(-cu_k[s] // 32) * 32 + 32 * s
        for j in range(cu_k[s + 1] - cu_k[s]):
            vt[:, :, start + 32 * (j // 32) + column_of[j % 32]] = v[cu_k[s] + j]
    return vt


@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 0, 127, 129], [32, 32], [0, 0, 5], [300], [31, 33, 0]])
def test_varlen_value_operand(rng, lengths):
    cu_k = offsets(lengths)
    v = rng.integers(1, 256, (int(cu_k[-1]), 2, 128), dtype=np.uint8)  # no zero bytes: gaps show
    v = v & np.uint8(0x7E) | np.uint8(1)  # no NaN codes (0x7F, 0xFF) either
    v8 = jnp.asarray(v).view(E4M3)
    vt = jax.jit(fp8_varlen_value_operand)(v8, cu_k)
    np.testing.assert_array_equal(np.asarray(vt.view(jnp.uint8)), value_operand_np(v, cu_k))
    # Every sequence starts on a 32-key group; ranges never overlap and stay inside the buffer.
    starts = np.asarray(varlen_value_columns(jnp.asarray(cu_k)))
    assert np.all(starts % KEY_GROUP == 0)
    ends = starts + np.diff(cu_k)
    assert np.all(ends[:-1] <= starts[1:]) and ends[-1] <= vt.shape[2]
    # And back: every token from its one column.
    back = jax.jit(varlen_value_from_operand, static_argnums=2)(vt, cu_k, int(cu_k[-1]))
    np.testing.assert_array_equal(np.asarray(back.view(jnp.uint8)), v)


def test_varlen_value_operand_with_traced_offsets():
    """One compiled program serves every packing with the same totals."""
    v8 = jnp.asarray(np.arange(1, 41, dtype=np.uint8).reshape(40, 1, 1).repeat(128, axis=2)).view(E4M3)
    fn = jax.jit(fp8_varlen_value_operand)
    for lengths in ([10, 30], [40, 0], [0, 40]):
        cu = offsets(lengths)
        want = value_operand_np(np.asarray(v8.view(jnp.uint8)), cu)
        np.testing.assert_array_equal(np.asarray(fn(v8, jnp.asarray(cu)).view(jnp.uint8)), want)


# ---- the varlen custom call


def fp8_varlen_hlo(implementation, window=None, per_head=False, causal=True) -> str:
    """An FP8 flash_attention_varlen lowered for CUDA (on this CPU host)."""
    descale = spec((2, 2) if per_head else (), jnp.float32)
    fn = functools.partial(
        call_varlen, max_q=200, max_k=260, causal=causal, window=window, implementation=implementation,
        return_lse=True, softmax_scale=0.25,
    )  # fmt: skip
    return cuda_hlo(fn, GOOD["q"], GOOD["k"], GOOD["v"], CU, CU, (descale,) * 3)


@pytest.mark.parametrize("layout", [None, "transposed", "staged"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize(
    "window, causal_attr, bounds",
    [
        (None, "true", (-1, -1)),
        ((16, 0), "false", (16, 0)),
        ((300, 0), "true", (-1, -1)),
        ((-1, 5), "true", (-1, -1)),
    ],
)
def test_varlen_custom_call(monkeypatch, layout, per_head, window, causal_attr, bounds):
    """By default (400 rows per KV head: the rule stages V) and with JZYFA_FP8_V_LAYOUT=staged the kernel
    alone on V as it is; with JZYFA_FP8_V_LAYOUT=transposed V's varlen V^T first (a gather, then the
    layout kernel), then the kernel with v_transposed. Windows that come down to causal (over the maxima)
    are the plain causal kernel's."""
    if layout is not None:
        monkeypatch.setenv(FP8_V_LAYOUT_ENV, layout)
    staged = layout != "transposed"
    hlo = fp8_varlen_hlo("kernel", window, per_head)
    (call,) = custom_call_lines(hlo, FFI_TARGET)
    # q, k, v as it is [12, 2, 128] (staged) or the varlen V^T [Hkv, 128, roundup32(12) + 32 * 3], the
    # offsets, three descales [2 * 2].
    v_operand = "f8e4m3fn[12,2,128]{2,1,0}" if staged else "f8e4m3fn[2,128,128]{2,1,0}"
    operands = f"f8e4m3fn[10,4,128]{{2,1,0}}, f8e4m3fn[12,2,128]{{2,1,0}}, {v_operand}, "
    operands += "s32[3]{0}, s32[3]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}"
    assert f"operand_layout_constraints={{{operands}}}" in call, call
    assert re.search(r"bf16\[10,4,128\]\{2,1,0\}, f32\[4,10\]\{1,0\}, s32\[1\]", call)
    attrs = attributes(call)
    assert attrs["causal"] == causal_attr and attrs["varlen"] == "true"
    assert window_attributes(call) == bounds
    assert attrs["max_seqlen_q"] == "200 : i64" and attrs["max_seqlen_k"] == "260 : i64"
    assert re.search(r"2.50*e-01 : f32", attrs["softmax_scale"])
    assert attrs["v_transposed"] == str(not staged).lower() and attrs["lean_p"] == "true"
    assert attrs["key_block"] == "0 : i64"
    layouts = custom_call_lines(hlo, FFI_TARGET_VALUE_OPERAND)
    if staged:
        assert not layouts  # no V layout pass before the kernel
    else:
        # V's layout: token rows gathered into the sequences' columns, then the dense layout's kernel
        # over them as one batch of 128 keys.
        (layout_call,) = layouts
        assert "operand_layout_constraints={f8e4m3fn[1,128,2,128]{3,2,1,0}}" in layout_call, layout_call


def test_varlen_key_block_env_is_not_passed(monkeypatch):
    """The forced key block is the dense kernel's: varlen calls pass 0 whatever JZYFA_FP8_KEY_BLOCK says."""
    monkeypatch.setenv(FP8_KEY_BLOCK_ENV, "192")
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "transposed")
    (call,) = custom_call_lines(fp8_varlen_hlo("kernel"), FFI_TARGET)
    assert "v_transposed = true" in call and "key_block = 0 : i64" in call


@pytest.mark.parametrize(
    "max_seqlen_q, heads_q, heads_kv, layout",
    [
        (8192, 16, 16, "staged"),  # the bench's batch (8192, 4096, ..., 64)
        (4096, 16, 8, "staged"),  # GQA: 8192 rows, the threshold
        (8193, 16, 16, "transposed"),
        (2048, 32, 4, "transposed"),  # 8 query heads per KV head: 16384 rows
        (32768, 16, 16, "transposed"),
    ],
)
def test_varlen_v_layout_follows_rows_per_kv_head(monkeypatch, max_seqlen_q, heads_q, heads_kv, layout):
    """The varlen rule (FP8_VARLEN_STAGED_V_MAX_ROWS on the longest sequence's rows per KV head) and the
    override both ways."""
    assert plan.fp8_varlen_value_layout(max_seqlen_q, heads_q, heads_kv) == layout
    rows = max_seqlen_q * (heads_q // heads_kv)
    assert (rows <= plan.FP8_VARLEN_STAGED_V_MAX_ROWS) == (layout == "staged")
    for override in ("staged", "transposed"):
        monkeypatch.setenv(FP8_V_LAYOUT_ENV, override)
        assert plan.fp8_varlen_value_layout(max_seqlen_q, heads_q, heads_kv) == override


def test_varlen_cuda_lowering_rejects_an_unknown_layout(monkeypatch):
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "sideways")
    with pytest.raises(ValueError, match=FP8_V_LAYOUT_ENV):
        fp8_varlen_hlo("kernel")


def test_varlen_path_follows_the_kernels_availability(rng, monkeypatch):
    (q8, k8, v8), descales, cu_q, cu_k = random_fp8_packed(rng, [7, 0, 12], [7, 3, 12])
    available = [False]
    monkeypatch.setattr(_platform, "kernel_available", lambda: available[0])
    args = (q8, k8, v8, cu_q, cu_k, *descales)

    def varlen(window, implementation=None):
        def fn(*a):
            return call_varlen(
                *a[:5], a[5:], max_q=12, max_k=12, window=window, implementation=implementation
            )

        return fn

    for window in ((-1, 0), (-1, -1), (4, 0)):
        available[0] = False
        assert path_of(varlen(window), *args) is plan.Path.REFERENCE
        available[0] = True
        assert path_of(varlen(window), *args) is plan.Path.PRIMITIVE
        assert path_of(varlen(window, "kernel"), *args) is plan.Path.KERNEL_REQUIRED
    assert len(custom_call_lines(fp8_varlen_hlo(None), FFI_TARGET)) == 1
    available[0] = False
    assert custom_call_lines(fp8_varlen_hlo(None), FFI_TARGET) == []


@pytest.mark.parametrize("layout", [None, "staged", "transposed"])
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (4, 1)])
def test_varlen_primitive_off_cuda_is_the_pure_jax_path(rng, monkeypatch, layout, window):
    """The primitive's non-CUDA lowering (what implementation=None runs on a CPU with the kernel faked
    available): V^T inverted where the layout transposed V, then dequantize + the exact reference: the
    pure-JAX path's result, bit for bit."""
    (q8, k8, v8), descales, cu_q, cu_k = random_fp8_packed(
        rng, [7, 0, 12, 40], [9, 3, 12, 33], pad_q=2, per_head=True
    )
    fn = jax.jit(functools.partial(call_varlen, max_q=40, max_k=33, window=window, return_lse=True))
    want = fn(q8, k8, v8, cu_q, cu_k, descales)
    if layout is not None:
        monkeypatch.setenv(FP8_V_LAYOUT_ENV, layout)
    monkeypatch.setattr(_platform, "kernel_available", lambda: True)
    jax.clear_caches()
    specs = bound_specs(
        lambda *a: call_varlen(*a[:5], a[5:], max_q=40, max_k=33, window=window),
        q8,
        k8,
        v8,
        cu_q,
        cu_k,
        *descales,
    )
    assert len(specs) == 1 and specs[0].fp8 and specs[0].varlen == (40, 33)
    hlo = cuda_hlo(
        lambda *a: call_varlen(*a[:5], a[5:], max_q=40, max_k=33, window=window),
        q8,
        k8,
        v8,
        cu_q,
        cu_k,
        *descales,
    )
    assert f"v_transposed = {str(layout == 'transposed').lower()}" in kernel_call_of(hlo)
    got = fn(q8, k8, v8, cu_q, cu_k, descales)
    assert_same(got, want)


# ---- the value-operand primitive (V into the FP8 kernel's operand layout)


def random_e4m3(rng: np.random.Generator, shape, *, avoid: int | None = None) -> jax.Array:
    """e4m3 values from uniformly random bytes: every code (NaNs, -0, subnormals), `avoid` excepted."""
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    if avoid is not None:
        codes[codes == avoid] = avoid ^ 0x01
    return jnp.asarray(codes.view(jnp.float8_e4m3fn))


def value_operand_bytes(v: np.ndarray) -> np.ndarray:
    """The operand's definition on bytes: vt[b, h, d, 32 g + k] = v[b, 32 g + physical_key(k), h, d]
    (zero past seq_k)."""
    v = np.asarray(v).view(np.uint8)
    batch, seq_k, heads_kv, head_dim = v.shape
    padded = np.zeros((batch, padded_keys(seq_k), heads_kv, head_dim), np.uint8)
    padded[:, :seq_k] = v
    keys = (np.arange(padded.shape[1]) // KEY_GROUP) * KEY_GROUP + np.tile(
        KEY_PERMUTATION, padded.shape[1] // KEY_GROUP
    )
    return padded[:, keys].transpose(0, 2, 3, 1)


def as_bytes(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("seq_k", [1, 31, 32, 33, 300])
@pytest.mark.parametrize("batch, heads_kv", [(1, 1), (2, 3)])
def test_value_operand_off_cuda_is_the_pure_jax_layout(rng, batch, seq_k, heads_kv):
    v = random_e4m3(rng, (batch, seq_k, heads_kv, 128))
    vt = jax.jit(fp8_value_operand_p.bind)(v)
    assert vt.shape == (batch, heads_kv, 128, padded_keys(seq_k)) and vt.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(as_bytes(vt), as_bytes(jax.jit(fp8_value_operand)(v)))
    np.testing.assert_array_equal(as_bytes(vt), value_operand_bytes(v))
    np.testing.assert_array_equal(as_bytes(fp8_value_operand_p.bind(v)), as_bytes(vt))  # eager


def test_value_operand_vmap_folds_into_the_batch(rng):
    vs = random_e4m3(rng, (3, 2, 40, 2, 128))
    got = jax.vmap(fp8_value_operand_p.bind, in_axes=1, out_axes=1)(vs)
    for i in range(2):
        np.testing.assert_array_equal(as_bytes(got[:, i]), as_bytes(fp8_value_operand(vs[:, i])))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seq_k, padded", [(1, 32), (300, 320), (4096, 4096)])
def test_value_operand_cuda_lowering_is_the_ffi_custom_call(seq_k, padded, head_dim):
    v = spec((2, seq_k, 3, head_dim))
    (call,) = custom_call_lines(cuda_hlo(fp8_value_operand_p.bind, v), FFI_TARGET_VALUE_OPERAND)
    assert "api_version=API_VERSION_TYPED_FFI" in call
    # Row-major operand and result, as the handler reads and writes them.
    assert f"f8e4m3fn[2,3,{head_dim},{padded}]{{3,2,1,0}} custom-call(" in call
    assert f"operand_layout_constraints={{f8e4m3fn[2,{seq_k},3,{head_dim}]{{3,2,1,0}}}}" in call


@pytest.mark.parametrize(
    "shape, dtype", [((2, 40, 3, 96), jnp.float8_e4m3fn), ((2, 40, 3, 128), jnp.float32)]
)
def test_value_operand_cuda_lowering_falls_back_where_the_kernel_does_not_serve(shape, dtype):
    hlo = cuda_hlo(fp8_value_operand_p.bind, jax.ShapeDtypeStruct(shape, dtype))
    assert FFI_TARGET_VALUE_OPERAND not in hlo


def test_value_operand_cpu_lowering_has_no_custom_call():
    v = spec((2, 300, 3, 128))
    text = (
        jax.jit(fp8_value_operand_p.bind).trace(v).lower(lowering_platforms=("cpu",)).as_text(dialect="hlo")
    )
    assert "custom-call" not in text


def test_fp8_kernel_path_takes_v_from_the_value_operand_call(rng, monkeypatch):
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "transposed")  # a short call: the rule would stage V
    (q8, k8, v8), descales = fp8_qkv(rng, batch=2, seq_q=40, seq_k=70, heads_q=4, heads_kv=2)
    hlo = cuda_hlo(primitive_call(scale=0.125, causal=True, required=True), q8, k8, v8, descales)
    assert_transposed(hlo, "2,2,128,96")
