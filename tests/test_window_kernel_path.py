"""The sliding-window kernel's JAX side on the CPU: the window attributes of the CUDA custom calls (dense
and varlen), the choice of path (the windowed kernels by default since they passed their GPU tests) and
their kill switch, the primitive's reference lowering, and sequence sharding with windows. (The
kernel itself: tests/test_window_kernel_gpu.py and tests/test_kernel_build.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, naive_varlen_f64, random_qkv
from hlo_utils import cuda_hlo, custom_call_lines, window_attributes
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_utils import cpu_mesh

import jzyfa
from jzyfa import api, primitive, sharding
from jzyfa.primitive import FFI_TARGET, flash_attention_fwd
from jzyfa.query_chunks import window_key_range
from jzyfa.reference import attention_reference
from jzyfa.varlen import varlen_attention_reference
from jzyfa.varlen_primitive import FFI_TARGET_VARLEN, flash_attention_varlen_fwd

pytestmark = pytest.mark.usefixtures("cpu_backend")

Q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
KV = jax.ShapeDtypeStruct((2, 500, 2, 128), jnp.bfloat16)


@pytest.fixture(autouse=True)
def no_gate_variables(monkeypatch):
    """Every test here sees the defaults: the kill switches' variables unset."""
    monkeypatch.delenv(api.UNVERIFIED_WINDOW_KERNEL_ENV, raising=False)
    monkeypatch.delenv(api.UNVERIFIED_VARLEN_KERNEL_ENV, raising=False)


def custom_call(fn, *args) -> str:
    (call,) = [line for line in cuda_hlo(fn, *args).splitlines() if "custom-call(" in line]
    return call


@pytest.mark.parametrize(
    "causal, window, want_causal, want_window",
    [
        (False, None, "false", (-1, -1)),
        (True, None, "true", (-1, -1)),  # the plain causal kernel
        (False, (64, 0), "false", (64, 0)),
        (False, (0, 0), "false", (0, 0)),
        (False, (-1, 5), "false", (-1, 5)),
        (False, (300, -1), "false", (300, -1)),
        (True, (127, 5), "false", (127, 0)),  # causal sets the right bound to 0
        (False, (8192, 0), "true", (-1, -1)),  # the whole prefix: causal
        (False, (8192, 8192), "false", (-1, -1)),  # no mask at all
        (False, (499, 299), "false", (-1, -1)),  # bounds that exclude no key of these lengths
        (False, (497, 298), "false", (497, 298)),
    ],
)
@pytest.mark.parametrize("implementation", [None, "kernel"])
def test_cuda_lowering_carries_the_window(implementation, causal, window, want_causal, want_window):
    """The default path and implementation="kernel" alike, with no variable set."""
    fn = functools.partial(jzyfa.flash_attention, causal=causal, window=window, implementation=implementation)
    call = custom_call(fn, Q, KV, KV)
    assert f'custom_call_target="{FFI_TARGET}"' in call
    assert f"causal = {want_causal}" in call
    assert window_attributes(call) == want_window


def test_default_calls_carry_no_window():
    """Without a window the custom call is the one it always was, plus window (-1, -1)."""
    for causal in (False, True):
        call = custom_call(functools.partial(jzyfa.flash_attention, causal=causal), Q, KV, KV)
        assert window_attributes(call) == (-1, -1) and f"causal = {str(causal).lower()}" in call


def test_kernel_path_is_the_default(rng):
    q, k, v = random_qkv(rng, seq_q=40, seq_k=72, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.bfloat16)
    assert api.WINDOW_KERNEL_VERIFIED
    for window in ((8, 0), (0, 0), (-1, 5), (3, 9)):
        assert api.choose_path(q, k, v, 0.125, False, window, "kernel") is api.Path.KERNEL_REQUIRED
        # implementation=None takes the primitive (its reference lowering on the CPU).
        assert api.choose_path(q, k, v, 0.125, False, window, None) is api.Path.PRIMITIVE
    # Lowered for the CPU, a required kernel is an error: the platform refuses it, not the kill switch.
    with pytest.raises(ValueError, match="non-CUDA platform"):
        jzyfa.flash_attention(q, k, v, window=(8, 0), implementation="kernel")
    # FP8 calls with windows stay on the pure-JAX path while the FP8 kernel's windows are gated
    # (api.FP8_WINDOW_KERNEL_VERIFIED; tests/test_fp8_window_kernel_path.py).
    q8 = q.astype(jnp.float8_e4m3fn)
    assert api.choose_fp8_path(q8, q8, q8, False, (8, 0), None) is api.Path.REFERENCE


def test_kill_switch(rng, monkeypatch):
    """WINDOW_KERNEL_VERIFIED (on since the windowed kernels passed their GPU tests) is a kill switch: off,
    sliding windows stay on the pure-JAX path and implementation="kernel" needs the variable."""
    q, k, v = random_qkv(rng, seq_q=40, seq_k=72, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.bfloat16)
    monkeypatch.setattr(api, "WINDOW_KERNEL_VERIFIED", False)
    with pytest.raises(
        ValueError,
        match=r"sliding windows are switched off .*window \(8, 0\).*JZYFA_UNVERIFIED_WINDOW_KERNEL=1",
    ):
        jzyfa.flash_attention(q, k, v, window=(8, 0), implementation="kernel")
    # Causal and none, and windows that come down to them, are not switched off.
    for causal, window in ((True, None), (False, None), (False, (200, 0)), (True, (-1, 3))):
        assert api.choose_path(q, k, v, 0.125, causal, window, "kernel") is api.Path.KERNEL_REQUIRED
        assert api.choose_path(q, k, v, 0.125, causal, window, None) is api.Path.PRIMITIVE
    # implementation=None keeps windows on the pure-JAX path while switched off, env or not.
    assert api.choose_path(q, k, v, 0.125, False, (8, 0), None) is api.Path.REFERENCE
    fn = jax.jit(functools.partial(jzyfa.flash_attention, window=(16, 4)))
    hlo = fn.trace(Q, KV, KV).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    assert custom_call_lines(hlo, FFI_TARGET) == []  # lowered for CUDA: no custom call
    monkeypatch.setenv(api.UNVERIFIED_WINDOW_KERNEL_ENV, "1")
    assert api.choose_path(q, k, v, 0.125, False, (8, 0), None) is api.Path.REFERENCE
    assert api.choose_path(q, k, v, 0.125, False, (8, 0), "kernel") is api.Path.KERNEL_REQUIRED
    # The variable lifts the switch: on the CPU a required kernel is then the platform's error.
    with pytest.raises(ValueError, match="non-CUDA platform"):
        jzyfa.flash_attention(q, k, v, window=(8, 0), implementation="kernel")


WINDOWS = [(0, 0), (1, 0), (5, 3), (-1, 5), (30, -1), (0, -1), (3, 0)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seq_q, seq_k", [(40, 40), (17, 70), (70, 17)])
def test_primitive_off_cuda_is_the_reference(rng, window, seq_q, seq_k):
    q, k, v = random_qkv(
        rng, seq_q=seq_q, seq_k=seq_k, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.bfloat16
    )
    call = functools.partial(flash_attention_fwd, softmax_scale=0.125, causal=False, kernel_required=False)
    out, lse = jax.jit(functools.partial(call, window=window))(q, k, v)
    want_out, want_lse = attention_reference(q, k, v, window=window, softmax_scale=0.125)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    f64_out, f64_lse = naive_attention_f64(q, k, v, causal=False, window=window, softmax_scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), f64_out, atol=2e-2)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(f64_lse))
    if seq_q > seq_k and window[1] >= 0:
        assert np.isneginf(lse).any()  # rows left of every key: O = 0, LSE = -inf


def test_api_runs_the_primitive_by_default_and_matches_float64(rng):
    q, k, v = random_qkv(rng, seq_q=33, seq_k=65, heads_q=4, heads_kv=1, head_dim=64, dtype=jnp.float16)
    fn = jax.jit(functools.partial(jzyfa.flash_attention, window=(6, 2), return_lse=True))
    assert FFI_TARGET in str(jax.make_jaxpr(fn)(q, k, v))  # the primitive, not the pure-JAX path
    out, lse = fn(q, k, v)
    f64_out, f64_lse = naive_attention_f64(q, k, v, causal=False, window=(6, 2))
    np.testing.assert_allclose(np.asarray(out, np.float32), f64_out, atol=2e-3)
    np.testing.assert_allclose(lse, f64_lse, atol=1e-4)
    # Gradients go through the reference with the same window.
    grad = jax.grad(lambda q: jnp.sum(fn(q, k, v)[0].astype(jnp.float32)))(q)
    want = jax.grad(lambda q: jnp.sum(attention_reference(q, k, v, window=(6, 2))[0].astype(jnp.float32)))(q)
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(want, np.float32), atol=1e-2)


def test_vmap_keeps_the_window():
    fn = functools.partial(jzyfa.flash_attention, window=(16, 4), implementation="kernel")
    q = jax.ShapeDtypeStruct((3,) + Q.shape, Q.dtype)
    kv = jax.ShapeDtypeStruct((3,) + KV.shape, KV.dtype)
    assert window_attributes(custom_call(jax.vmap(fn), q, kv, kv)) == (16, 4)


# ---- varlen


def offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.mark.parametrize("window", [(4, 0), (-1, 2), (0, 0), (6, -1)])
def test_varlen_primitive_off_cuda_is_the_reference(rng, window):
    lengths_q, lengths_k = [5, 0, 17, 1], [5, 3, 0, 30]
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    shapes = [(sum(lengths_q) + 2, 4, 64), (sum(lengths_k), 2, 64), (sum(lengths_k), 2, 64)]
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
    call = functools.partial(
        flash_attention_varlen_fwd,
        max_seqlen_q=17,
        max_seqlen_k=30,
        softmax_scale=0.125,
        causal=False,
        kernel_required=False,
        window=window,
    )
    out, lse = jax.jit(call)(q, k, v, cu_q, cu_k)
    want_out, want_lse = varlen_attention_reference(
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), 17, 30, window=window, softmax_scale=0.125
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    f64_out, f64_lse = naive_varlen_f64(q, k, v, cu_q, cu_k, causal=False, window=window, softmax_scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), f64_out, atol=2e-2)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(f64_lse))


@pytest.mark.parametrize(
    "causal, window, want_causal, want_window",
    [
        (False, None, "false", (-1, -1)),
        (True, None, "true", (-1, -1)),
        (False, (64, 0), "false", (64, 0)),
        (True, (64, 9), "false", (64, 0)),
        (False, (300, 0), "true", (-1, -1)),  # beyond max_seqlen_k: causal
        (False, (-1, 7), "false", (-1, 7)),
    ],
)
@pytest.mark.parametrize("implementation", [None, "kernel"])
def test_varlen_cuda_lowering_carries_the_window(
    monkeypatch, implementation, causal, window, want_causal, want_window
):
    """The default path (where the kernel is available: faked) and implementation="kernel" alike, with no
    variable set."""
    monkeypatch.setattr(api._platform, "kernel_available", lambda: True)
    q = jax.ShapeDtypeStruct((300, 8, 128), jnp.float16)
    kv = jax.ShapeDtypeStruct((500, 2, 128), jnp.float16)
    cu = jax.ShapeDtypeStruct((5,), jnp.int32)
    fn = functools.partial(
        jzyfa.flash_attention_varlen,
        max_seqlen_q=200,
        max_seqlen_k=260,
        causal=causal,
        window=window,
        implementation=implementation,
    )
    call = custom_call(fn, q, kv, kv, cu, cu)
    assert f'custom_call_target="{FFI_TARGET_VARLEN}"' in call
    assert f"causal = {want_causal}" in call
    assert window_attributes(call) == want_window


@pytest.mark.parametrize(
    "dtype, causal, window", [(jnp.bfloat16, True, (2, 0)), (jnp.float16, False, (-1, 2))]
)
def test_varlen_window_kill_switch(rng, monkeypatch, dtype, causal, window):
    cu = offsets([4, 6])
    q, k, v = (jnp.asarray(rng.standard_normal((10, 2, 64)), dtype) for _ in range(3))
    monkeypatch.setattr(api._platform, "kernel_available", lambda: True)
    # By default: the kernel, for implementation=None too, with no variable set.
    assert api.choose_varlen_path(q, k, v, 2, 6, 0.125, window, "kernel") is api.Path.KERNEL_REQUIRED
    assert api.choose_varlen_path(q, k, v, 2, 6, 0.125, window, None) is api.Path.PRIMITIVE
    # Windows switched off: refused for implementation="kernel", the pure-JAX path for None.
    monkeypatch.setattr(api, "WINDOW_KERNEL_VERIFIED", False)
    with pytest.raises(
        ValueError, match="cannot serve this varlen call: the kernel's sliding windows are switched off"
    ):
        jzyfa.flash_attention_varlen(
            q, k, v, cu, cu, 6, 6, causal=causal, window=window, implementation="kernel"
        )
    assert api.choose_varlen_path(q, k, v, 2, 6, 0.125, window, None) is api.Path.REFERENCE
    # Causal is not a sliding window: still the kernel.
    assert api.choose_varlen_path(q, k, v, 2, 6, 0.125, (-1, 0), None) is api.Path.PRIMITIVE
    # The variable lifts it for implementation="kernel" only.
    monkeypatch.setenv(api.UNVERIFIED_WINDOW_KERNEL_ENV, "1")
    assert api.choose_varlen_path(q, k, v, 2, 6, 0.125, window, "kernel") is api.Path.KERNEL_REQUIRED
    assert api.choose_varlen_path(q, k, v, 2, 6, 0.125, window, None) is api.Path.REFERENCE
    # The varlen kernel switched off too: the varlen variable is needed as well.
    monkeypatch.setattr(api, "VARLEN_KERNEL_VERIFIED", False)
    with pytest.raises(ValueError, match="the varlen kernel is switched off"):
        api.choose_varlen_path(q, k, v, 2, 6, 0.125, window, "kernel")
    monkeypatch.setenv(api.UNVERIFIED_VARLEN_KERNEL_ENV, "1")
    assert api.choose_varlen_path(q, k, v, 2, 6, 0.125, window, "kernel") is api.Path.KERNEL_REQUIRED


# ---- sequence sharding


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
    _, run, (out_sharding, lse_sharding), arg_shardings = sharding.partition(
        primitive.flash_attention_shard, 0.125, False, False, (8, 0), mesh, (q, kv, kv), None
    )
    per_shard = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=tuple(s.spec for s in arg_shardings),
        out_specs=(out_sharding.spec, lse_sharding.spec),
    )
    hlo = jax.jit(per_shard).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    calls = custom_call_lines(hlo, FFI_TARGET)
    assert len(calls) == 4
    # Shard 0 sees keys 0..15 (window (8, 0) as is); shards 1-3 keys 16s-8 .. 16s+15, 24 keys.
    assert sorted(window_attributes(c) for c in calls) == [(8, 0)] * 4
    assert sum("bf16[1,16,4,128]{3,2,1,0}" in c for c in calls) == 1
    assert sum("bf16[1,24,4,128]{3,2,1,0}" in c for c in calls) == 3


def test_windows_past_the_kernels_int32_range_fall_back():
    """The windowed kernels need seq_q + seq_k <= 2^30 (total_q + total_k for varlen)."""
    q = jax.ShapeDtypeStruct((1, 8388480, 1, 64), jnp.bfloat16)  # the kernel's longest seq_q
    kv = jax.ShapeDtypeStruct((1, (1 << 30) - 8388480 + 1, 1, 64), jnp.bfloat16)
    assert "seq_q + seq_k <= 2^30" in api.kernel_problem(q, kv, kv, 0.125, False, (8, 0))
    assert api.kernel_problem(q, kv, kv, 0.125, True, None) is None  # causal: the plain kernel
    assert api.choose_path(q, kv, kv, 0.125, False, (8, 0), None) is api.Path.REFERENCE
    q, kv = (jax.ShapeDtypeStruct((n, 1, 64), jnp.bfloat16) for n in (1 << 29, (1 << 29) + 1))
    with pytest.raises(ValueError, match=r"total_q \+ total_k <= 2\^30"):
        api.choose_varlen_path(q, kv, kv, 1, 128, 0.125, (8, 0), "kernel")
