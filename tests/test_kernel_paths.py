"""The 16-bit kernels' JAX side on the CPU, for every 16-bit row of `jzyfa.plan.KERNELS` (head dims 64,
128, 256 and MLA's 192/128; masks none, causal, window; dense and varlen): which path a call takes per
`implementation`, the attributes and operands of the CUDA custom call `jzyfa_attention_fwd` (windows
canonicalised: those that come down to causal or none are the plain kernels'), what is refused outside
the table and why, the launch limits, the primitive's CPU lowering (the exact reference) with Sq != Sk,
GQA and rows that see no key, vmap, gradients and sequence sharding with windows. (The kernels
themselves: tests/test_*_gpu.py and tests/test_kernel_build.py; the table itself: tests/test_plan.py.)"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, naive_varlen_f64, offsets, random_qkv
from hlo_utils import cuda_hlo, custom_call_lines, window_attributes
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_utils import cpu_mesh

import jzyfa
from jzyfa import _platform, api, plan, primitives, sharding
from jzyfa.plan import Config
from jzyfa.primitives import FFI_TARGET
from jzyfa.query_chunks import window_key_range
from jzyfa.reference import attention_reference
from jzyfa.varlen import varlen_attention_reference

pytestmark = pytest.mark.usefixtures("cpu_backend")

ROWS = sorted(row for row in plan.KERNELS if row.family == "16bit")
HEAD_DIMS = sorted({row.head_dims for row in ROWS})
DENSE_ROWS = [row for row in ROWS if row.layout == "dense"]
VARLEN_ROWS = [row for row in ROWS if row.layout == "varlen"]
MASK_OPTIONS = {"none": {"causal": False}, "causal": {"causal": True}, "window": {"window": (8, 0)}}


def dims_id(dims) -> str:
    return f"{dims[0]}-{dims[1]}"


def row_id(row: Config) -> str:
    return f"{row.family}-{dims_id(row.head_dims)}-{row.mask}-{row.layout}"


@pytest.fixture
def kernel_available(monkeypatch):
    """The kernel faked available (this host has no GPU): what implementation=None sees on a Hopper GPU."""
    monkeypatch.setattr(_platform, "kernel_available", lambda: True)


def dense_specs(head_dims, dtype=jnp.bfloat16, *, batch=2, seq_q=300, seq_k=500, heads_q=8, heads_kv=2):
    qk, dv = head_dims
    shapes = [(batch, seq_q, heads_q, qk), (batch, seq_k, heads_kv, qk), (batch, seq_k, heads_kv, dv)]
    return tuple(jax.ShapeDtypeStruct(s, dtype) for s in shapes)


def packed_specs(head_dims, dtype=jnp.bfloat16, *, total_q=300, total_k=500, num_seqs=4):
    qk, dv = head_dims
    shapes = [(total_q, 8, qk), (total_k, 2, qk), (total_k, 2, dv)]
    cu = jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32)
    return (*(jax.ShapeDtypeStruct(s, dtype) for s in shapes), cu, cu)


def varlen_fn(max_q=200, max_k=260, **kwargs):
    return functools.partial(jzyfa.flash_attention_varlen, max_seqlen_q=max_q, max_seqlen_k=max_k, **kwargs)


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
    """The path a call took: no primitive (the pure-JAX path), the primitive, or the required kernel."""
    specs = bound_specs(fn, *args)
    if not specs:
        return plan.Path.REFERENCE
    (spec,) = specs
    return plan.Path.KERNEL_REQUIRED if spec.kernel_required else plan.Path.PRIMITIVE


def row_call(row: Config, implementation, dtype=jnp.bfloat16):
    """(fn, *abstract args) of a call of this row's configuration."""
    options = dict(MASK_OPTIONS[row.mask], implementation=implementation)
    if row.layout == "dense":
        return functools.partial(jzyfa.flash_attention, **options), *dense_specs(row.head_dims, dtype)
    return varlen_fn(**options), *packed_specs(row.head_dims, dtype)


# ---- which path, per implementation


@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_path_per_implementation(monkeypatch, row):
    """implementation="kernel": the required kernel; "xla": the pure-JAX path; None: the primitive for
    dense calls on a CPU backend (its CPU lowering, so that the program lowers for CUDA too), for varlen
    calls only where the kernel is available."""
    assert path_of(*row_call(row, "kernel")) is plan.Path.KERNEL_REQUIRED
    assert path_of(*row_call(row, "xla")) is plan.Path.REFERENCE
    default = plan.Path.PRIMITIVE if row.layout == "dense" else plan.Path.REFERENCE
    assert path_of(*row_call(row, None)) is default
    assert (len(kernel_calls(*row_call(row, None))) == 1) == (row.layout == "dense")
    monkeypatch.setattr(_platform, "kernel_available", lambda: True)
    assert path_of(*row_call(row, None)) is plan.Path.PRIMITIVE
    assert len(kernel_calls(*row_call(row, None))) == 1
    # Lowered for the CPU, a required kernel is the platform's error.
    fn, *args = row_call(row, "kernel")
    with pytest.raises(ValueError, match="implementation='kernel' needs a Hopper GPU.*non-CUDA platform"):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",))


def test_a_required_kernel_refuses_to_run_on_the_cpu(rng):
    q, k, v = random_qkv(rng, seq_q=40, seq_k=72, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="non-CUDA platform"):
        jzyfa.flash_attention(q, k, v, window=(8, 0), implementation="kernel")
    cu = offsets([7, 0, 33])
    with pytest.raises(ValueError, match="non-CUDA platform"):
        jzyfa.flash_attention_varlen(
            q[0], k[0, :40], v[0, :40], cu, cu, 33, 33, causal=True, implementation="kernel"
        )


# ---- configurations outside the table: the reason, and the pure-JAX path

OUTSIDE = [
    ((128, 64), jnp.bfloat16),
    ((64, 128), jnp.bfloat16),
    ((192, 192), jnp.bfloat16),
    ((192, 64), jnp.bfloat16),
    ((128, 192), jnp.bfloat16),
    ((96, 96), jnp.bfloat16),
    ((256, 128), jnp.float16),
    ((64, 64), jnp.float32),
    ((192, 128), jnp.float32),
    ((256, 256), jnp.float32),
]


@pytest.mark.parametrize("layout", ["dense", "varlen"])
@pytest.mark.parametrize("mask", ["causal", "window"])
@pytest.mark.parametrize(
    "head_dims, dtype", OUTSIDE, ids=lambda x: dims_id(x) if isinstance(x, tuple) else None
)
def test_configurations_outside_the_table_say_why(kernel_available, layout, mask, head_dims, dtype):
    if dtype == jnp.float32:  # the dtype's reason comes first
        problem = "the kernels take bf16, f16 or float8_e4m3fn inputs, got float32"
    else:
        config = Config("16bit", head_dims, mask, layout)
        assert config not in plan.KERNELS
        problem = plan.config_problem(config)
        assert f"got {head_dims[0]}/{head_dims[1]}" in problem
    row = Config("16bit", head_dims, mask, layout)
    fn, *args = row_call(row, "kernel", dtype)
    with pytest.raises(
        ValueError, match="^" + re.escape(f"implementation='kernel' cannot serve this call: {problem}")
    ):
        jax.eval_shape(fn, *args)
    # implementation=None serves them on the pure-JAX path (no custom call, even where a kernel runs),
    # with v's head dim.
    fn, *args = row_call(row, None, dtype)
    assert path_of(fn, *args) is plan.Path.REFERENCE
    assert FFI_TARGET not in cuda_hlo(fn, *args)
    out = jax.eval_shape(fn, *args)
    assert out.shape[-1] == head_dims[1]


def test_the_16_bit_table_problem_sentences():
    """The sentences implementation="kernel" quotes, for the 16-bit family."""
    assert plan.config_problem(Config("16bit", (192, 192), "causal", "dense")) == (
        "the 16-bit (bf16, f16) kernels take head dims (q and k / v) 64/64, 128/128, 192/128, 256/256, got 192/192"
    )


# ---- the custom call: operands, results, attributes


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("row", [row for row in ROWS if row.mask != "window"], ids=row_id)
def test_custom_call_operands_and_results(row, dtype):
    """q and k qk wide, v and out dv (MLA: 192 and 128), GQA heads, Sq != Sk; lse [B, Hq, Sq] (varlen
    [Hq, total_q]); the tile counter; the default scale 1/sqrt(qk); every attribute present."""
    qk, dv = row.head_dims
    t = "bf16" if dtype == jnp.bfloat16 else "f16"
    causal = row.mask == "causal"
    fn, *args = row_call(row, "kernel", dtype)
    call = kernel_call(fn, *args)
    assert "api_version=API_VERSION_TYPED_FFI" in call
    attrs = attributes(call)
    assert attrs["causal"] == str(causal).lower()
    assert attrs["window_left"] == attrs["window_right"] == "-1 : i64"
    assert np.float32(attrs["softmax_scale"].split(" : ")[0]) == np.float32(1 / np.sqrt(qk))
    assert attrs["lean_p"] == "true" and attrs["v_transposed"] == "false" and attrs["key_block"] == "0 : i64"
    if row.layout == "dense":
        assert f"({t}[2,300,8,{dv}]{{3,2,1,0}}, f32[2,8,300]{{2,1,0}}, s32[1]{{0}}) custom-call(" in call
        assert operand_shapes(call) == [f"{t}[2,300,8,{qk}]", f"{t}[2,500,2,{qk}]", f"{t}[2,500,2,{dv}]"]
        assert attrs["varlen"] == "false"
        assert attrs["max_seqlen_q"] == attrs["max_seqlen_k"] == "0 : i64"
    else:
        assert f"({t}[300,8,{dv}]{{2,1,0}}, f32[8,300]{{1,0}}, s32[1]{{0}}) custom-call(" in call
        assert operand_shapes(call) == [
            f"{t}[300,8,{qk}]", f"{t}[500,2,{qk}]", f"{t}[500,2,{dv}]", "s32[5]", "s32[5]",
        ]  # fmt: skip
        assert attrs["varlen"] == "true"
        assert attrs["max_seqlen_q"] == "200 : i64" and attrs["max_seqlen_k"] == "260 : i64"


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_custom_call_takes_the_given_scale(causal):
    fn = varlen_fn(causal=causal, softmax_scale=0.25, implementation="kernel", return_lse=True)
    call = kernel_call(fn, *packed_specs((128, 128), jnp.float16))
    assert re.search(r"softmax_scale = 2.50*e-01 : f32", call)
    assert f"causal = {str(causal).lower()}" in call
    assert re.search(r"custom-call\((\S+), (\S+), (\S+), (\S+), (\S+)\)", call)  # q, k, v, cu_q, cu_k


DENSE_WINDOWS = [
    (False, None, "false", (-1, -1)),
    (True, None, "true", (-1, -1)),  # the plain causal kernel
    (False, (64, 0), "false", (64, 0)),
    (False, (0, 0), "false", (0, 0)),
    (False, (-1, 5), "false", (-1, 5)),
    (False, (300, -1), "false", (300, -1)),
    (True, (127, 5), "false", (127, 0)),  # causal sets the right bound to 0
    (True, (-1, 3), "true", (-1, -1)),  # causal with an unbounded left: causal
    (False, (8192, 0), "true", (-1, -1)),  # the whole prefix: causal
    (False, (8192, 8192), "false", (-1, -1)),  # no mask at all
    (False, (499, 299), "false", (-1, -1)),  # bounds that exclude no key of these lengths
    (False, (497, 298), "false", (497, 298)),
]


@pytest.mark.parametrize("causal, window, want_causal, want_window", DENSE_WINDOWS)
@pytest.mark.parametrize("implementation", [None, "kernel"])
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=dims_id)
def test_dense_custom_call_carries_the_canonical_window(
    head_dims, implementation, causal, window, want_causal, want_window
):
    """Over 300 queries and 500 keys; the default path and implementation="kernel" alike."""
    fn = functools.partial(jzyfa.flash_attention, causal=causal, window=window, implementation=implementation)
    call = kernel_call(fn, *dense_specs(head_dims))
    assert f"causal = {want_causal}" in call
    assert window_attributes(call) == want_window
    mask, kernel_causal, kernel_window = api.kernel_mask(causal, window, 300, 500)
    assert (str(kernel_causal).lower(), kernel_window) == (want_causal, want_window)
    assert mask == ("window" if want_window != (-1, -1) else "causal" if want_causal == "true" else "none")


VARLEN_WINDOWS = [
    (False, None, "false", (-1, -1)),
    (True, None, "true", (-1, -1)),
    (False, (64, 0), "false", (64, 0)),
    (True, (64, 9), "false", (64, 0)),
    (False, (300, 0), "true", (-1, -1)),  # beyond max_seqlen_k: causal
    (False, (-1, 7), "false", (-1, 7)),
    (False, (100, 30), "false", (100, 30)),
    (True, (100, 30), "false", (100, 0)),
]


@pytest.mark.parametrize("causal, window, want_causal, want_window", VARLEN_WINDOWS)
@pytest.mark.parametrize("implementation", [None, "kernel"])
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=dims_id)
def test_varlen_custom_call_carries_the_canonical_window(
    kernel_available, head_dims, implementation, causal, window, want_causal, want_window
):
    """Canonicalised over the maxima (200 queries, 260 keys); implementation=None where the kernel is
    available."""
    fn = varlen_fn(causal=causal, window=window, implementation=implementation)
    call = kernel_call(fn, *packed_specs(head_dims, jnp.float16))
    assert f"causal = {want_causal}" in call and "varlen = true" in call
    assert window_attributes(call) == want_window


def test_vmap_folds_into_one_call_and_keeps_the_window():
    """Dense: the mapped axis folds into the batch (one launch), window and head dims kept."""
    for head_dims in HEAD_DIMS:
        qk, dv = head_dims
        stacked = [jax.ShapeDtypeStruct((3,) + x.shape, x.dtype) for x in dense_specs(head_dims)]
        fn = functools.partial(jzyfa.flash_attention, window=(16, 4), implementation="kernel")
        call = kernel_call(jax.vmap(fn), *stacked)
        assert window_attributes(call) == (16, 4)
        assert f"bf16[6,300,8,{dv}]" in call and f"bf16[6,500,2,{qk}]" in call
        out = jax.eval_shape(functools.partial(fn, return_lse=True), *dense_specs(head_dims))
        assert [x.shape for x in out] == [(2, 300, 8, dv), (2, 8, 300)]


def test_vmap_of_varlen_calls_is_one_call_per_element(rng):
    """Packed batches do not fold: vmap maps the call (one custom call in a loop body) and equals a loop."""
    specs = packed_specs((128, 128))
    stacked = [jax.ShapeDtypeStruct((3,) + x.shape, x.dtype) for x in specs]
    fn = jax.vmap(varlen_fn(window=(16, 4), implementation="kernel"))
    (call,) = kernel_calls(fn, *stacked)
    assert "bf16[300,8,128]" in call and window_attributes(call) == (16, 4)
    lengths = [[5, 0, 12], [12, 3, 2], [0, 0, 17]]
    cus = np.stack([offsets(x) for x in lengths])
    q, k, v = (jnp.asarray(rng.standard_normal((3, 17, 2, 64)), jnp.bfloat16) for _ in range(3))
    call = varlen_fn(max_q=17, max_k=17, window=(4, 1), return_lse=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_platform, "kernel_available", lambda: True)
        assert path_of(jax.vmap(call), q, k, v, cus, cus) is plan.Path.PRIMITIVE
        out, lse = jax.jit(jax.vmap(call))(q, k, v, cus, cus)
    for i in range(3):
        want_out, want_lse = call(q[i], k[i], v[i], cus[i], cus[i], implementation="xla")
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(want_out, np.float32))
        np.testing.assert_array_equal(np.asarray(lse[i]), np.asarray(want_lse))


def test_gradients_lower_the_forward_kernel_only(rng):
    for head_dims in HEAD_DIMS:
        q, k, v = random_qkv(
            rng, seq_q=12, seq_k=20, heads_q=4, heads_kv=2, head_dim=head_dims[0], head_dim_v=head_dims[1]
        )

        def loss(q, k=k, v=v):
            return jnp.sum(jzyfa.flash_attention(q, k, v, causal=True, implementation="kernel"))

        # The backward is the pure-JAX one from residuals until the plan has a backward kernel.
        assert len(kernel_calls(jax.value_and_grad(loss), q)) == 1


# ---- launch limits


def test_windows_past_the_kernels_int32_range_fall_back(kernel_available):
    """The windowed kernels need seq_q + seq_k <= 2^30 (total_q + total_k for varlen); causal at those
    sizes is the plain kernel's."""
    q = jax.ShapeDtypeStruct((1, plan.KERNEL_MAX_SEQ_Q, 1, 64), jnp.bfloat16)  # the kernel's longest seq_q
    kv = jax.ShapeDtypeStruct((1, (1 << 30) - plan.KERNEL_MAX_SEQ_Q + 1, 1, 64), jnp.bfloat16)
    window = functools.partial(jzyfa.flash_attention, window=(8, 0))
    with pytest.raises(
        ValueError, match=r"cannot serve this call: the kernels' sliding windows take seq_q \+ seq_k <= 2\^30"
    ):
        jax.eval_shape(functools.partial(window, implementation="kernel"), q, kv, kv)
    assert path_of(window, q, kv, kv) is plan.Path.REFERENCE
    causal = functools.partial(jzyfa.flash_attention, causal=True)
    assert path_of(causal, q, kv, kv) is plan.Path.PRIMITIVE
    assert path_of(functools.partial(causal, implementation="kernel"), q, kv, kv) is plan.Path.KERNEL_REQUIRED
    q, kv = (jax.ShapeDtypeStruct((n, 1, 64), jnp.bfloat16) for n in (1 << 29, (1 << 29) + 1))
    cu = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = varlen_fn(max_q=1, max_k=128, window=(8, 0))
    with pytest.raises(ValueError, match=r"cannot serve this call: .*total_q \+ total_k <= 2\^30"):
        jax.eval_shape(functools.partial(fn, implementation="kernel"), q, kv, kv, cu, cu)
    assert path_of(fn, q, kv, kv, cu, cu) is plan.Path.REFERENCE
    assert path_of(varlen_fn(max_q=1, max_k=128, causal=True), q, kv, kv, cu, cu) is plan.Path.PRIMITIVE


# ---- the primitive's CPU lowering: the exact reference

WINDOWS = [(-1, -1), (-1, 0), (0, 0), (1, 0), (5, 3), (-1, 5), (30, -1), (0, -1), (3, 0)]


def dense_spec(window, scale=0.125):
    causal = window == (-1, 0)
    return primitives.make_spec(softmax_scale=scale, causal=causal, window=(-1, -1) if causal else window)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seq_q, seq_k", [(40, 40), (17, 70), (70, 17)])
def test_dense_primitive_off_cuda_is_the_reference(rng, window, seq_q, seq_k):
    q, k, v = random_qkv(
        rng, seq_q=seq_q, seq_k=seq_k, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.bfloat16
    )
    spec = dense_spec(window)
    out, lse = jax.jit(functools.partial(primitives.attention_fwd, spec=spec))(q, k, v)
    # Compiled alike: the reference's program, bit for bit.
    want_out, want_lse = jax.jit(functools.partial(attention_reference, window=window, softmax_scale=0.125))(
        q, k, v
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    f64_out, f64_lse = naive_attention_f64(q, k, v, causal=False, window=window, softmax_scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), f64_out, atol=2e-2)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(f64_lse))
    if seq_q > seq_k and window[1] >= 0:
        assert np.isneginf(lse).any()  # rows left of every key: O = 0, LSE = -inf
        rows = np.isneginf(np.asarray(lse))  # [B, H, Sq]
        assert not np.asarray(out, np.float32).transpose(0, 2, 1, 3)[rows].any()


@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=dims_id)
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_api_default_path_binds_the_primitive_and_matches_float64(rng, head_dims, mask):
    """implementation=None on a CPU: the primitive, lowered to the reference; equal to implementation="xla",
    near float64, with Sq > Sk (rows with no key under causal and windows: O = 0, LSE = -inf) and GQA."""
    qk, dv = head_dims
    q, k, v = random_qkv(
        rng, seq_q=70, seq_k=33, heads_q=4, heads_kv=1, head_dim=qk, head_dim_v=dv, dtype=jnp.float16
    )
    options = {"causal": mask == "causal", "window": (6, 2) if mask == "window" else None, "return_lse": True}
    fn = functools.partial(jzyfa.flash_attention, **options)
    assert path_of(fn, q, k, v) is plan.Path.PRIMITIVE
    out, lse = jax.jit(fn)(q, k, v)
    want_out, want_lse = jax.jit(functools.partial(fn, implementation="xla"))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    f64_out, f64_lse = naive_attention_f64(
        *(np.asarray(x, np.float32) for x in (q, k, v)),
        causal=options["causal"],
        window=options["window"],
        softmax_scale=qk**-0.5,
    )
    assert out.shape == (1, 70, 4, dv)
    np.testing.assert_allclose(np.asarray(out, np.float32), f64_out, atol=2e-3)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(f64_lse))
    finite = np.isfinite(f64_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], f64_lse[finite], atol=1e-4)
    if mask == "causal":
        assert np.isneginf(np.asarray(lse)[:, :, :37]).all()  # Sq > Sk: the first rows see no key
        assert not np.asarray(out[:, :37], np.float32).any()


def test_gradients_through_the_primitive_are_the_reference_ones(rng):
    q, k, v = random_qkv(rng, seq_q=33, seq_k=65, heads_q=4, heads_kv=1, head_dim=64, dtype=jnp.float16)
    fn = jax.jit(functools.partial(jzyfa.flash_attention, window=(6, 2)))
    assert path_of(fn, q, k, v) is plan.Path.PRIMITIVE
    grad = jax.grad(lambda q: jnp.sum(fn(q, k, v).astype(jnp.float32)))(q)
    want = jax.grad(lambda q: jnp.sum(attention_reference(q, k, v, window=(6, 2))[0].astype(jnp.float32)))(q)
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(want, np.float32), atol=1e-2)


def varlen_spec(max_q, max_k, window, scale=0.125):
    causal = window == (-1, 0)
    return primitives.make_spec(
        softmax_scale=scale, causal=causal, window=(-1, -1) if causal else window, varlen=(max_q, max_k)
    )


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (4, 0), (-1, 2), (0, 0), (6, -1)])
@pytest.mark.parametrize(
    "lengths_q, lengths_k, pad_q",
    [
        ([5, 0, 17, 1], [5, 3, 0, 30], 0),  # empty sequences on either side
        ([20, 65], [10, 65], 3),  # more queries than keys; 3 tokens past cu_seqlens_q[-1]
        ([1, 1, 1], [64, 1, 33], 0),
    ],
)
def test_varlen_primitive_off_cuda_is_the_reference(rng, window, lengths_q, lengths_k, pad_q):
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    max_q, max_k = max(lengths_q), max(lengths_k)
    shapes = [(sum(lengths_q) + pad_q, 4, 64), (sum(lengths_k), 2, 64), (sum(lengths_k), 2, 64)]
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
    spec = varlen_spec(max_q, max_k, window)
    out, lse = jax.jit(functools.partial(primitives.attention_fwd, spec=spec))(q, k, v, cu_q, cu_k)
    want_out, want_lse = jax.jit(
        functools.partial(varlen_attention_reference, window=window, softmax_scale=0.125),
        static_argnums=(5, 6),
    )(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), max_q, max_k)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (4, q.shape[0])
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    # And that is attention per sequence, with zeros / -inf past the last sequence.
    f64_out, f64_lse = naive_varlen_f64(q, k, v, cu_q, cu_k, causal=False, window=window, softmax_scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), f64_out, atol=2e-2)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(f64_lse))
    if pad_q:
        assert np.all(np.asarray(out[-pad_q:], np.float32) == 0) and np.all(np.isneginf(lse[:, -pad_q:]))


@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=dims_id)
def test_varlen_api_where_the_kernel_runs_matches_float64(rng, kernel_available, head_dims):
    """implementation=None where the kernel is available binds the primitive; its CPU lowering serves the
    call: against float64 per sequence, with an empty sequence, a one-token one and tokens past
    cu_seqlens_q[-1] (O = 0, LSE = -inf)."""
    qk, dv = head_dims
    lengths_q, lengths_k, pad = [5, 0, 17, 1], [5, 3, 0, 30], 3
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    shapes = [(sum(lengths_q) + pad, 4, qk), (sum(lengths_k), 2, qk), (sum(lengths_k), 2, dv)]
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float16) for s in shapes)
    fn = varlen_fn(max_q=17, max_k=30, window=(6, 2), return_lse=True)
    assert path_of(fn, q, k, v, cu_q, cu_k) is plan.Path.PRIMITIVE
    out, lse = jax.jit(fn)(q, k, v, cu_q, cu_k)
    want_out, want_lse = naive_varlen_f64(
        q, k, v, cu_q, cu_k, causal=False, softmax_scale=qk**-0.5, window=(6, 2)
    )
    assert out.shape == (q.shape[0], 4, dv)
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=2e-2)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], atol=1e-3)
    assert not np.asarray(out[-pad:], np.float32).any() and np.isneginf(np.asarray(lse)[:, -pad:]).all()


def test_varlen_gradients_through_the_primitive_are_the_reference_ones(rng):
    lengths_q, lengths_k = [6, 0, 11], [9, 4, 11]
    cu_q, cu_k = jnp.asarray(offsets(lengths_q)), jnp.asarray(offsets(lengths_k))
    shapes = [(17, 4, 64), (24, 2, 64), (24, 2, 64)]
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16).astype(jnp.float32) for s in shapes)
    weights = jnp.asarray(rng.standard_normal(q.shape[:2] + (64,)), jnp.float32)
    spec = varlen_spec(11, 11, (-1, 0))

    def loss_kernel_path(q, k, v):
        out, lse = api._differentiable(spec, q, k, v, (cu_q, cu_k))
        return jnp.sum(out * weights) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    def loss_reference(q, k, v):
        out, lse = varlen_attention_reference(
            q, k, v, cu_q, cu_k, 11, 11, window=(-1, 0), softmax_scale=0.125
        )
        return jnp.sum(out * weights) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    got = jax.jit(jax.grad(loss_kernel_path, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss_reference, argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want):  # the backward from residuals: float32 rounding apart
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


# ---- sequence sharding with windows


def test_window_key_range_matches_the_whole_sequence():
    """Every chunk of every small case: keys [begin, end) under the shifted window mask exactly as the
    window does on the whole sequence."""

    def visible(seq_q, seq_k, window):
        left, right = window
        pos = np.arange(seq_q)[:, None] + seq_k - seq_q
        j = np.arange(seq_k)[None, :]
        return ((left < 0) | (j >= pos - left)) & ((right < 0) | (j <= pos + right))

    for seq_q, seq_k in [(8, 8), (8, 12), (12, 5), (6, 1), (1, 6)]:
        for window in [(-1, -1), (-1, 0), (0, 0), (1, 0), (3, 2), (7, -1), (-1, 9), (20, 1)]:
            whole = visible(seq_q, seq_k, window)
            for start in range(seq_q):
                for length in range(1, seq_q - start + 1):
                    begin, end, local = window_key_range(start, length, seq_q, seq_k, window)
                    got = np.zeros((length, seq_k), bool)
                    if end > begin:
                        assert min(local) >= -1
                        got[:, begin:end] = visible(length, end - begin, local)
                    np.testing.assert_array_equal(got, whole[start : start + length])


@pytest.mark.parametrize(
    "causal, window", [(False, (5, 3)), (True, (9, 0)), (False, (-1, 4)), (False, (0, -1))]
)
@pytest.mark.parametrize("seq_q, seq_k", [(32, 32), (32, 48), (32, 20)])
def test_sequence_sharded_windows_match_the_reference(rng, causal, window, seq_q, seq_k):
    mesh = cpu_mesh((2, 4), ("data", "seq"))
    q, k, v = random_qkv(rng, batch=2, seq_q=seq_q, seq_k=seq_k, heads_q=2, heads_kv=1, dtype=jnp.float16)
    fn = functools.partial(jzyfa.flash_attention, causal=causal, window=window, return_lse=True)
    q_sharding = NamedSharding(mesh, P("data", "seq"))
    kv_sharding = NamedSharding(mesh, P("data"))
    sharded = jax.jit(fn, in_shardings=(q_sharding, kv_sharding, kv_sharding))
    assert "CustomSPMDPartitioning" in sharded.lower(q, k, v).as_text()
    out, lse = sharded(q, k, v)
    want_out, want_lse = attention_reference(q, k, v, causal=causal, window=window)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), atol=1e-3)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-6)


def test_sequence_shards_lower_to_shifted_windows_for_cuda():
    """Each sequence shard's custom call reads only the keys its window reaches, with the window moved
    to match: 4 shards of 16 rows, 64 keys, window (8, 0)."""
    mesh = cpu_mesh((2, 4), ("data", "tensor"))
    q = jax.ShapeDtypeStruct(
        (2, 64, 16, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", "tensor"))
    )
    kv = jax.ShapeDtypeStruct((2, 64, 4, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    spec = primitives.make_spec(softmax_scale=0.125, causal=False, window=(8, 0))
    _, run, (out_sharding, lse_sharding), arg_shardings = sharding.partition(
        primitives.attention_shard, "fwd", spec, mesh, (q, kv, kv), None
    )
    per_shard = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=tuple(s.spec for s in arg_shardings),
        out_specs=(out_sharding.spec, lse_sharding.spec),
    )
    calls = kernel_calls(per_shard, q, kv, kv)
    assert len(calls) == 4
    # Shard 0 sees keys 0..15 (window (8, 0) as is); shards 1-3 keys 16s-8 .. 16s+15, 24 keys.
    assert sorted(window_attributes(c) for c in calls) == [(8, 0)] * 4
    assert sum("bf16[1,16,4,128]{3,2,1,0}" in c for c in calls) == 1
    assert sum("bf16[1,24,4,128]{3,2,1,0}" in c for c in calls) == 3
