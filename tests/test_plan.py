"""jzyfa.plan, the table from a call's configuration to the kernel that serves it: its rows, the
problems it names for everything else, the launch limits, the path choice, and that every row lowers
to exactly one `jzyfa_attention_fwd` custom call for CUDA (on this CPU machine) while configurations
outside it raise naming the problem. The README's support matrix is checked in tests/test_readme.py.
"""

import dataclasses
import importlib
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_utils import custom_call_lines

import jzyfa
from jzyfa import _platform, plan
from jzyfa._validation import FP8_VARLEN_HEAD_DIMS
from jzyfa.plan import Config, Path
from jzyfa.primitives import FFI_TARGET, FFI_TARGET_VALUE_OPERAND

# --- the table's rows -----------------------------------------------------------------------------

# The packed FP8 inputs flash_attention_varlen takes (outside them: an argument error before any plan).
FP8_VARLEN_DIMS = [(d, d) for d in FP8_VARLEN_HEAD_DIMS]
SIXTEEN_BIT_DIMS = [(64, 64), (128, 128), (256, 256), (192, 128)]
EXPECTED_ROWS = (
    {Config("16bit", d, m, layout) for d in SIXTEEN_BIT_DIMS for m in plan.MASKS for layout in plan.LAYOUTS}
    | {Config("fp8", d, m, layout) for d in ((64, 64), (128, 128)) for m in plan.MASKS for layout in plan.LAYOUTS}
    | {Config("fp8", (256, 256), m, "dense") for m in plan.MASKS}
    | {Config("fp8", (192, 128), m, "dense") for m in ("none", "causal")}
    | {Config("16bit", d, m, layout, "bwd") for d in SIXTEEN_BIT_DIMS for m in plan.MASKS for layout in plan.LAYOUTS}
    | {Config("int8", (128, 128), m, "dense") for m in plan.MASKS}
    | {Config("int8", (192, 128), m, "dense") for m in ("none", "causal")}
)


def test_kernels_are_the_rows_that_passed_their_gpu_tests():
    assert plan.KERNELS == EXPECTED_ROWS
    assert len(plan.KERNELS) == 4 * 3 * 2 + 2 * 3 * 2 + 3 + 2 + 4 * 3 * 2 + 3 + 2
    # Built, not served: FP8 varlen at head dim 256, INT8 at head dim 256 and INT8 varlen at 128.
    assert plan.BUILT_AWAITING_GPU_TESTS == (
        {Config("fp8", (256, 256), m, "varlen") for m in plan.MASKS}
        | {Config("int8", (256, 256), m, "dense") for m in plan.MASKS}
        | {Config("int8", (128, 128), m, "varlen") for m in plan.MASKS}
    )
    assert not plan.BUILT_AWAITING_GPU_TESTS & plan.KERNELS
    assert plan.MLA_HEAD_DIMS == (192, 128)


def test_config_as_tuple_is_the_extensions_form():
    row = Config("fp8", (192, 128), "causal", "dense")
    assert row.as_tuple() == ("fp8", 192, 128, "causal", "dense", "fwd")


def test_kernels_equal_the_built_extensions_table():
    try:
        module = importlib.import_module("jzyfa._jzyfa_ffi")
    except ImportError as e:
        pytest.skip(f"the extension jzyfa._jzyfa_ffi is not built here ({e})")
    if not hasattr(module, "kernels"):
        pytest.skip("the built extension jzyfa._jzyfa_ffi has no kernels() (built from older sources)")
    assert set(map(tuple, module.kernels())) == {c.as_tuple() for c in plan.KERNELS | plan.BUILT_AWAITING_GPU_TESTS}


# --- config_problem -------------------------------------------------------------------------------


@pytest.mark.parametrize("row", sorted(plan.KERNELS), ids=str)
def test_rows_have_no_problem(row):
    assert plan.config_problem(row) is None
    assert plan.kernel_for(row) == row


# Every configuration over the table's families, head dims, masks and layouts that is not a row.
ALL_DIMS = sorted({row.head_dims for row in plan.KERNELS} | {(96, 96), (128, 64)})
NOT_ROWS = [
    Config(family, dims, mask, layout)
    for family, dims, mask, layout in itertools.product(plan.FAMILIES, ALL_DIMS, plan.MASKS, plan.LAYOUTS)
    if Config(family, dims, mask, layout) not in plan.KERNELS
]


def test_not_rows_cover_the_gaps():
    assert Config("fp8", (192, 128), "window", "dense") in NOT_ROWS
    assert Config("fp8", (192, 128), "causal", "varlen") in NOT_ROWS
    assert Config("fp8", (128, 64), "none", "dense") in NOT_ROWS
    assert Config("16bit", (96, 96), "none", "dense") in NOT_ROWS


@pytest.mark.parametrize(
    "config,sentence",
    [
        (
            Config("16bit", (96, 96), "none", "dense"),
            (
                "the 16-bit (bf16, f16) kernels take head dims (q and k / v) 64/64, 128/128, 192/128, "
                "256/256, got 96/96"
            ),
        ),
        (
            Config("16bit", (128, 64), "causal", "varlen"),
            (
                "the 16-bit (bf16, f16) kernels take head dims (q and k / v) 64/64, 128/128, 192/128, "
                "256/256, got 128/64"
            ),
        ),
        (
            Config("fp8", (96, 96), "causal", "dense"),
            "the FP8 (e4m3) kernels take head dims (q and k / v) 64/64, 128/128, 192/128, 256/256, got 96/96",
        ),
        (
            Config("fp8", (128, 64), "none", "varlen"),
            "the FP8 (e4m3) kernels take head dims (q and k / v) 64/64, 128/128, 192/128, 256/256, got 128/64",
        ),
        (
            Config("fp8", (192, 128), "causal", "varlen"),
            "the FP8 (e4m3) kernels have no varlen layout at head dims 192/128",
        ),
        (
            Config("fp8", (192, 128), "window", "dense"),
            "the FP8 (e4m3) kernel at head dims 192/128 (dense) takes masks none, causal, not a 'window' mask",
        ),
    ],
    ids=lambda x: str(x) if isinstance(x, Config) else "",
)
def test_config_problem_sentences(config, sentence):
    assert plan.config_problem(config) == sentence
    assert plan.kernel_for(config) is None


@pytest.mark.parametrize("config", NOT_ROWS, ids=str)
def test_every_configuration_outside_the_table_has_a_problem(config):
    problem = plan.config_problem(config)
    assert problem and problem.startswith("the ")
    assert {"16bit": "16-bit", "fp8": "FP8", "int8": "INT8"}[config.family] in problem


def test_backward_rows_name_what_the_backward_kernels_take():
    assert plan.config_problem(Config("16bit", (128, 128), "causal", "dense", "bwd")) is None
    problem = plan.config_problem(Config("16bit", (96, 96), "causal", "dense", "bwd"))
    assert "64/64, 128/128, 192/128, 256/256" in problem and "96/96" in problem
    assert "no backward kernel for FP8" in plan.config_problem(Config("fp8", (128, 128), "causal", "dense", "bwd"))


# --- call_problem: the launch limits --------------------------------------------------------------

DENSE = Config("16bit", (128, 128), "causal", "dense")
DENSE_WINDOW = Config("16bit", (128, 128), "window", "dense")
VARLEN = Config("16bit", (128, 128), "causal", "varlen")
VARLEN_WINDOW = Config("16bit", (128, 128), "window", "varlen")
FP8_VARLEN = Config("fp8", (128, 128), "none", "varlen")


def dense(batch=2, seq_q=128, seq_k=128, heads_q=8, heads_kv=2):
    return plan.CallSizes("dense", batch, seq_q, seq_k, heads_q, heads_kv)


def packed(num_seqs=4, max_q=128, max_k=128, heads_q=8, heads_kv=2, total_q=256, total_k=256):
    return plan.CallSizes("varlen", num_seqs, max_q, max_k, heads_q, heads_kv, total_q, total_k)


def test_call_problem_none_inside_the_limits():
    assert plan.call_problem(DENSE, dense(), 0.1) is None
    assert plan.call_problem(VARLEN, packed(), 0.1) is None
    assert (
        plan.call_problem(DENSE, dense(batch=plan.KERNEL_MAX_BATCH, seq_q=plan.KERNEL_MAX_SEQ_Q), 0.1) is None
    )


def test_call_problem_reports_the_table_first():
    config = Config("16bit", (96, 96), "none", "dense")
    assert plan.call_problem(config, dense(batch=10**6), -1.0) == plan.config_problem(config)


@pytest.mark.parametrize(
    "config,sizes,scale,sentence",
    [
        (DENSE, dense(), 0.0, "the kernels need softmax_scale > 0, got 0.0"),
        (DENSE, dense(), -0.5, "the kernels need softmax_scale > 0, got -0.5"),
        (
            DENSE,
            dense(batch=plan.KERNEL_MAX_BATCH + 1),
            0.1,
            f"the kernels take batch <= 65535, got {plan.KERNEL_MAX_BATCH + 1}",
        ),
        (
            DENSE,
            dense(seq_q=plan.KERNEL_MAX_SEQ_Q + 1),
            0.1,
            f"the kernels take seq_q <= {65535 * 128}, got {plan.KERNEL_MAX_SEQ_Q + 1}",
        ),
        (DENSE, dense(seq_k=0), 0.1, "the kernels need seq_q and seq_k >= 1, got 128 and 0"),
        (DENSE, dense(seq_q=0), 0.1, "the kernels need seq_q and seq_k >= 1, got 0 and 128"),
        (
            DENSE_WINDOW,
            dense(batch=1, seq_q=plan.KERNEL_MAX_SEQ_Q, seq_k=(1 << 30) - plan.KERNEL_MAX_SEQ_Q + 1),
            0.1,
            f"the kernels' sliding windows take seq_q + seq_k <= 2^30, got {(1 << 30) + 1}",
        ),
        (VARLEN, packed(total_k=0), 0.1, "the kernels need total_q and total_k >= 1, got 256 and 0"),
        (
            VARLEN,
            packed(total_q=(1 << 30) + 1),
            0.1,
            f"the kernels take at most {1 << 30} tokens, got {(1 << 30) + 1}",
        ),
        (
            VARLEN,
            packed(num_seqs=(1 << 14) - 1, max_q=128 * 2048, heads_q=64, total_q=1 << 20),
            0.1,
            f"the kernels take (num_seqs + 1) * ceil(max_seqlen_q / 128) * heads_q <= 2^30, got {(1 << 14) * 2048 * 64}",
        ),
        (
            VARLEN_WINDOW,
            packed(total_q=1 << 29, total_k=(1 << 29) + 1),
            0.1,
            f"the kernels' sliding windows take total_q + total_k <= 2^30, got {(1 << 30) + 1}",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_call_problem_limits(config, sizes, scale, sentence):
    assert plan.call_problem(config, sizes, scale) == sentence


def test_window_token_limit_applies_to_windowed_calls_only():
    sizes = dense(batch=1, seq_q=plan.KERNEL_MAX_SEQ_Q, seq_k=(1 << 30) - plan.KERNEL_MAX_SEQ_Q + 1)
    assert plan.call_problem(DENSE, sizes, 0.1) is None
    assert plan.call_problem(DENSE_WINDOW, sizes, 0.1) is not None


def test_fp8_varlen_value_keys_stay_within_the_token_and_tile_limits():
    # V^T's key columns (total_k + 32 * (num_seqs + 1), padded) must stay below
    # FP8_VARLEN_MAX_VALUE_KEYS. V^T is used past FP8_VARLEN_STAGED_V_MAX_ROWS rows per KV head, so
    # ceil(max_q / 128) * heads_q >= 64 and the tile limit keeps num_seqs + 1 <= 2^24: with the token
    # limit, the largest calls the other limits let through stay below it.
    max_q = plan.FP8_VARLEN_STAGED_V_MAX_ROWS + 1
    assert plan.fp8_varlen_value_layout(max_q, 1, 1) == "transposed"
    num_seqs = plan.KERNEL_MAX_TILES // 65 - 1
    largest = packed(
        num_seqs=num_seqs, max_q=max_q, heads_q=1, heads_kv=1, total_q=plan.KERNEL_MAX_TOKENS,
        total_k=plan.KERNEL_MAX_TOKENS,
    )  # fmt: skip
    assert plan.call_problem(FP8_VARLEN, largest, 0.1) is None
    assert plan._varlen_padded_keys(plan.KERNEL_MAX_TOKENS, num_seqs) < plan.FP8_VARLEN_MAX_VALUE_KEYS
    # One more token is refused by the token limit.
    past = dataclasses.replace(largest, total_k=plan.KERNEL_MAX_TOKENS + 1)
    assert plan.call_problem(FP8_VARLEN, past, 0.1) == (
        f"the kernels take at most {1 << 30} tokens, got {(1 << 30) + 1}"
    )


# --- choose_path ------------------------------------------------------------------------------------


def platform(monkeypatch, backend, *, hopper_reason=None):
    monkeypatch.setattr(_platform, "default_backend", lambda: backend)
    reason = hopper_reason if backend == "gpu" else f"the default JAX backend is {backend!r}, not a CUDA GPU"
    monkeypatch.setattr(_platform, "hopper_unavailable_reason", lambda: reason)
    monkeypatch.setattr(_platform, "kernel_available", lambda: reason is None)


@pytest.mark.parametrize("cpu_primitive", [False, True])
@pytest.mark.parametrize("backend,hopper_reason", [("cpu", None), ("gpu", None), ("gpu", "not Hopper (8.0)")])
def test_xla_is_always_the_reference(monkeypatch, backend, hopper_reason, cpu_primitive):
    platform(monkeypatch, backend, hopper_reason=hopper_reason)
    for problem in (None, "some problem"):
        assert plan.choose_path(problem, "xla", cpu_primitive=cpu_primitive) is Path.REFERENCE


def test_default_path(monkeypatch):
    platform(monkeypatch, "cpu")
    assert plan.choose_path(None, None, cpu_primitive=True) is Path.PRIMITIVE
    assert plan.choose_path(None, None, cpu_primitive=False) is Path.REFERENCE
    assert plan.choose_path("a problem", None, cpu_primitive=True) is Path.REFERENCE
    platform(monkeypatch, "gpu")  # a Hopper GPU with the extension
    assert plan.choose_path(None, None, cpu_primitive=False) is Path.PRIMITIVE
    assert plan.choose_path("a problem", None, cpu_primitive=False) is Path.REFERENCE
    platform(monkeypatch, "gpu", hopper_reason="device 0 has compute capability 8.0")
    assert plan.choose_path(None, None, cpu_primitive=True) is Path.REFERENCE
    assert plan.choose_path(None, None, cpu_primitive=False) is Path.REFERENCE


def test_kernel_path(monkeypatch):
    platform(monkeypatch, "cpu")  # lowering for CPU refuses later; lowering for CUDA works
    assert plan.choose_path(None, "kernel", cpu_primitive=False) is Path.KERNEL_REQUIRED
    platform(monkeypatch, "gpu")
    assert plan.choose_path(None, "kernel", cpu_primitive=False) is Path.KERNEL_REQUIRED
    with pytest.raises(ValueError, match=r"^implementation='kernel' cannot serve this call: the why$"):
        plan.choose_path("the why", "kernel", cpu_primitive=True)
    platform(monkeypatch, "gpu", hopper_reason="device 0 has compute capability 8.0")
    with pytest.raises(ValueError, match=r"^implementation='kernel' cannot run here: device 0 has compute"):
        plan.choose_path(None, "kernel", cpu_primitive=True)
    with pytest.raises(ValueError, match="cannot serve this call: the why"):  # the call's problem first
        plan.choose_path("the why", "kernel", cpu_primitive=True)


# --- implementation="kernel": one custom call per row, the problem for everything else --------------

BATCH, SEQ, HEADS_Q, HEADS_KV = 2, 64, 4, 2
LENGTHS = [20, 0, 44]
MASK_OPTIONS = {"none": dict(causal=False), "causal": dict(causal=True), "window": dict(window=(8, 0))}
# (causal, window_left, window_right) attributes of each mask kind at these lengths.
MASK_ATTRIBUTES = {"none": ("false", -1, -1), "causal": ("true", -1, -1), "window": ("false", 8, 0)}


def kernel_call(config: Config, implementation="kernel"):
    """(fn, args) of a call of this configuration (implementation="kernel" unless told), as abstract
    arrays."""
    dtype = jnp.float8_e4m3fn if config.family == "fp8" else jnp.bfloat16  # int8: precision="int8" on bf16
    dqk, dv = config.head_dims
    array = lambda *shape, dtype=dtype: jax.ShapeDtypeStruct(shape, dtype)
    options = dict(
        MASK_OPTIONS[config.mask], softmax_scale=0.125, implementation=implementation, return_lse=True
    )
    if config.family == "int8":
        options["precision"] = "int8"
    descales = [array(dtype=jnp.float32)] * 3 if config.family == "fp8" else []
    names = ("descale_q", "descale_k", "descale_v")
    if config.layout == "dense":
        args = [
            array(BATCH, SEQ, HEADS_Q, dqk),
            array(BATCH, SEQ, HEADS_KV, dqk),
            array(BATCH, SEQ, HEADS_KV, dv),
        ]

        def fn(q, k, v, *d):
            return jzyfa.flash_attention(q, k, v, **dict(zip(names, d)), **options)

    else:
        total = sum(LENGTHS)
        args = [array(total, HEADS_Q, dqk), array(total, HEADS_KV, dqk), array(total, HEADS_KV, dv)]
        args += [array(len(LENGTHS) + 1, dtype=jnp.int32)] * 2

        def fn(q, k, v, cu_q, cu_k, *d):
            return jzyfa.flash_attention_varlen(
                q, k, v, cu_q, cu_k, max(LENGTHS), max(LENGTHS), **dict(zip(names, d)), **options
            )

    return fn, args + descales


def cuda_hlo(fn, args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")


def attributes(call: str) -> dict[str, str]:
    """The custom call's attributes (its backend_config) as name -> text."""
    (config,) = re.findall(r"backend_config=\{(.*)\}", call)
    return dict(item.split(" = ", 1) for item in config.split(", "))


ATTRIBUTE_NAMES = {
    "softmax_scale",
    "causal",
    "window_left",
    "window_right",
    "varlen",
    "max_seqlen_q",
    "max_seqlen_k",
    "lean_p",
    "v_transposed",
    "key_block",
    "softcap",
}


@pytest.mark.parametrize("config", sorted(plan.KERNELS), ids=str)
def test_each_row_lowers_to_one_custom_call_for_cuda(cpu_backend, config):
    fn, args = kernel_call(config)
    hlo = cuda_hlo(fn, args)
    (call,) = custom_call_lines(hlo, FFI_TARGET)
    assert "api_version=API_VERSION_TYPED_FFI" in call
    attrs = attributes(call)
    assert set(attrs) == ATTRIBUTE_NAMES
    causal, left, right = MASK_ATTRIBUTES[config.mask]
    assert attrs["causal"] == causal
    assert attrs["window_left"] == f"{left} : i64" and attrs["window_right"] == f"{right} : i64"
    value, kind = attrs["softmax_scale"].split(" : ")
    assert kind == "f32" and np.float32(value) == np.float32(0.125)
    varlen = config.layout == "varlen"
    assert attrs["varlen"] == str(varlen).lower()
    max_seqlen = f"{max(LENGTHS) if varlen else 0} : i64"
    assert attrs["max_seqlen_q"] == attrs["max_seqlen_k"] == max_seqlen
    assert attrs["lean_p"] == "true"
    assert attrs["key_block"] == "0 : i64"  # no override: the launch's rule
    assert attrs["softcap"] == "0.000000e+00 : f32"  # none
    # Operands: q, k, v, [cu_seqlens_q, cu_seqlens_k], [descales flattened to 1-D]; results out, lse,
    # the tile counter.
    operands = call.split("operand_layout_constraints={")[1].split("}, api_version")[0]
    dqk, dv = config.head_dims
    fp8, int8 = config.family == "fp8", config.family == "int8"
    element = "f8e4m3fn" if fp8 else "s8" if int8 else "bf16"
    if varlen:
        total, num_seqs = sum(LENGTHS), len(LENGTHS)
        q_shape, k_shape = f"[{total},{HEADS_Q},{dqk}]", f"[{total},{HEADS_KV},{dqk}]"
        out = f"(bf16[{total},{HEADS_Q},{dv}]{{2,1,0}}, f32[{HEADS_Q},{total}]{{1,0}}, s32[1]{{0}})"
        extras = [f"s32[{num_seqs + 1}]"] * 2 + [f"f32[{num_seqs * HEADS_KV}]"] * 3 * fp8
    else:
        q_shape, k_shape = f"[{BATCH},{SEQ},{HEADS_Q},{dqk}]", f"[{BATCH},{SEQ},{HEADS_KV},{dqk}]"
        out = f"(bf16[{BATCH},{SEQ},{HEADS_Q},{dv}]{{3,2,1,0}}, f32[{BATCH},{HEADS_Q},{SEQ}]{{2,1,0}}, s32[1]{{0}})"
        extras = [f"f32[{BATCH * HEADS_KV}]"] * 3 * fp8
        if int8:  # q_scale, k_scale per 128 tokens and head, descale_v per (batch, KV head)
            blocks = -(-SEQ // 128)
            extras = [f"f32[{BATCH},{HEADS_Q},{blocks}]", f"f32[{BATCH},{HEADS_KV},{blocks}]", f"f32[{BATCH},{HEADS_KV}]"]
    assert call.split(" = ", 1)[1].startswith(out + " custom-call(")
    listed = [shape.split("{")[0] for shape in re.findall(r"\w+\[[\d,]*\]\{[\d,]*\}", operands)]
    assert listed[:2] == [element + q_shape, element + k_shape]
    if int8:  # V as it is, or V^T from the layout pass (head dim 256's only V)
        vt_keys = -(-SEQ // 32) * 32
        v_shape = f"[{BATCH},{HEADS_KV},{dv},{vt_keys}]" if attrs["v_transposed"] == "true" else f"[{BATCH},{SEQ},{HEADS_KV},{dv}]"
        assert listed[2] == "f8e4m3fn" + v_shape
    assert listed[3:] == extras
    assert len(listed) == 3 + 2 * varlen + 3 * (fp8 or int8)
    if attrs["v_transposed"] == "true":
        assert fp8 or int8  # V^T from the layout pass (or its pure-JAX form)
    # On a CPU, implementation="kernel" has no kernel to run: lowering for the CPU refuses.
    with pytest.raises(ValueError, match="implementation='kernel' needs a Hopper GPU"):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",))


@pytest.mark.parametrize("config", NOT_ROWS, ids=str)
def test_configurations_outside_the_table_raise_naming_the_problem(cpu_backend, config):
    fn, args = kernel_call(config)
    if config.family == "fp8" and config.layout == "varlen" and config.head_dims not in FP8_VARLEN_DIMS:
        # No path takes packed FP8 inputs at other head dims: an argument error, whatever the implementation.
        for implementation in ("kernel", None, "xla"):
            fn, args = kernel_call(config, implementation)
            with pytest.raises(ValueError, match="flash_attention_varlen takes FP8 inputs with one head_dim of 64, 128 or 256"):
                jax.eval_shape(fn, *args)
        return
    expected = "implementation='kernel' cannot serve this call: " + plan.config_problem(config)
    with pytest.raises(ValueError, match="^" + re.escape(expected)):
        jax.eval_shape(fn, *args)
    # The default path serves them, with no custom call (the pure-JAX path).
    fn, args = kernel_call(config, implementation=None)
    assert FFI_TARGET not in cuda_hlo(fn, args)


# --- the FP8 per-call choices and their overrides (read at trace time) -----------------------------


def fp8_custom_call(config: Config) -> tuple[dict[str, str], str]:
    """(attributes of the jzyfa_attention_fwd call, the whole HLO) of this FP8 row lowered for CUDA."""
    jax.clear_caches()  # the overrides are read when a call is traced
    fn, args = kernel_call(config)
    hlo = cuda_hlo(fn, args)
    (call,) = custom_call_lines(hlo, FFI_TARGET)
    return attributes(call), hlo


@pytest.mark.parametrize("name", [plan.FP8_V_LAYOUT_ENV, plan.FP8_KEY_BLOCK_ENV])
def test_bad_override_values_raise_naming_the_variable(cpu_backend, monkeypatch, name):
    assert name in ("JZYFA_FP8_V_LAYOUT", "JZYFA_FP8_KEY_BLOCK")
    monkeypatch.setenv(name, "wide")
    with pytest.raises(ValueError, match=f"^{name} must be one of .* \\(or unset\\), got 'wide'"):
        plan.fp8_key_block((1, 64, 2, 128), (1, 64, 2, 128), causal=True)
    jax.clear_caches()
    fn, args = kernel_call(Config("fp8", (128, 128), "causal", "dense"))
    with pytest.raises(ValueError, match=name):
        cuda_hlo(fn, args)
    monkeypatch.setenv(name, "")  # empty is unset
    assert plan.fp8_key_block((1, 64, 2, 128), (1, 64, 2, 128), causal=True) in (128, 192)


@pytest.mark.parametrize("layout", plan.FP8_V_LAYOUTS)
@pytest.mark.parametrize("row", sorted(r for r in plan.KERNELS if r.family == "fp8"), ids=str)
def test_v_layout_override_sets_v_transposed(cpu_backend, monkeypatch, row, layout):
    monkeypatch.setenv(plan.FP8_V_LAYOUT_ENV, layout)
    attrs, hlo = fp8_custom_call(row)
    # Head dims 64 and 256 have no staged kernel: V^T whatever the override.
    transposed = layout == "transposed" or row.head_dims in ((64, 64), (256, 256))
    assert attrs["v_transposed"] == str(transposed).lower()
    # V^T from the layout kernel (varlen: after gathering each sequence's keys).
    assert len(custom_call_lines(hlo, FFI_TARGET_VALUE_OPERAND)) == transposed
    assert attrs["key_block"] == "0 : i64"  # no key block override


@pytest.mark.parametrize("key_block", ["128", "192"])
@pytest.mark.parametrize("row", sorted(r for r in plan.KERNELS if r.family == "fp8"), ids=str)
@pytest.mark.parametrize("layout", plan.FP8_V_LAYOUTS)
def test_key_block_attribute_only_on_dense_hd128_unwindowed_v_transposed_calls(
    cpu_backend, monkeypatch, row, layout, key_block
):
    monkeypatch.setenv(plan.FP8_V_LAYOUT_ENV, layout)
    monkeypatch.setenv(plan.FP8_KEY_BLOCK_ENV, key_block)
    attrs, _ = fp8_custom_call(row)
    applies = (
        row.layout == "dense"
        and row.head_dims == (128, 128)
        and row.mask != "window"
        and layout == "transposed"
    )
    assert attrs["key_block"] == f"{key_block if applies else 0} : i64"


def test_key_block_auto_is_the_launchs_rule(cpu_backend, monkeypatch):
    monkeypatch.setenv(plan.FP8_V_LAYOUT_ENV, "transposed")
    monkeypatch.setenv(plan.FP8_KEY_BLOCK_ENV, "auto")
    attrs, _ = fp8_custom_call(Config("fp8", (128, 128), "none", "dense"))
    assert attrs["key_block"] == "0 : i64"
    assert plan.fp8_key_block_override() == 0


def test_fp8_key_block_follows_the_override_where_it_applies(monkeypatch):
    shapes = (1, 64, 2, 128), (1, 64, 2, 128)
    monkeypatch.setenv(plan.FP8_V_LAYOUT_ENV, "transposed")
    monkeypatch.setenv(plan.FP8_KEY_BLOCK_ENV, "192")
    assert plan.fp8_key_block(*shapes, causal=True) == 192
    assert plan.fp8_key_block(*shapes, causal=False, window=(8, 0)) != 192 or jzyfa.extension_loaded()
    monkeypatch.setenv(plan.FP8_V_LAYOUT_ENV, "staged")
    if not jzyfa.extension_loaded():  # without the extension the launch's rule is 128
        assert plan.fp8_key_block(*shapes, causal=True) == 128


def test_fp8_value_layout_rule():
    # Up to FP8_STAGED_V_MAX_ROWS query rows per KV head staged (short rows see few keys), else V^T.
    rows = plan.FP8_STAGED_V_MAX_ROWS
    common = dict(seq_k=64, head_dim=128, causal=True, window=(-1, 0))
    if not jzyfa.extension_loaded():
        assert plan.fp8_value_layout(rows // 4, 8, 2, **common) == "staged"
    assert plan.fp8_value_layout(rows // 4 + 1, 8, 2, **common) == "transposed"
    assert plan.fp8_varlen_value_layout(plan.FP8_VARLEN_STAGED_V_MAX_ROWS, 1, 1) == "staged"
    assert plan.fp8_varlen_value_layout(plan.FP8_VARLEN_STAGED_V_MAX_ROWS + 1, 1, 1) == "transposed"
