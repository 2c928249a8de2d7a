"""The V-operand kernel (ffi/fp8_value_operand.cu, target `jzyfa_fp8_value_operand`) on a Hopper GPU:
bitwise what the pure-JAX `fp8_layout.fp8_value_operand` gives, written into a poisoned (NaN-filled,
donated) output buffer; and the handler's checks.

Skipped without a Hopper GPU and the built extension.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_utils import requires_hopper

from jzyfa.fp8_layout import KEY_GROUP, KEY_PERMUTATION, fp8_value_operand, padded_keys
from jzyfa.primitives import FFI_TARGET_VALUE_OPERAND, fp8_value_operand_p

pytestmark = [pytest.mark.gpu, requires_hopper]

# NaN in float8_e4m3fn (0xFF is the other one): what a poisoned output is filled with.
E4M3_NAN_BYTE = 0x7F


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


def run_poisoned(v: jax.Array) -> np.ndarray:
    """The kernel writing into a donated buffer of e4m3 NaNs (0x7F); its bytes."""

    def call(v, poison):
        del poison
        return fp8_value_operand_p.bind(v)

    batch, seq_k, heads_kv, head_dim = v.shape
    poison = jnp.full((batch, heads_kv, head_dim, padded_keys(seq_k)), jnp.nan, jnp.float8_e4m3fn)
    assert np.all(as_bytes(poison[:1, :1, :1]) == E4M3_NAN_BYTE)
    fn = jax.jit(call, donate_argnums=(1,), keep_unused=True)
    hlo = fn.lower(v, poison).compile().as_text()
    assert f'custom_call_target="{FFI_TARGET_VALUE_OPERAND}"' in hlo
    assert "input_output_alias" in hlo
    return as_bytes(fn(v, poison))


@pytest.mark.parametrize(
    "shape",
    [
        (2, 300, 3, 128),
        (1, 1, 1, 128),  # one key: 31 zero columns
        (3, 31, 2, 128),
        (1, 33, 5, 128),
        (1, 4097, 2, 128),
        (16, 1024, 16, 128),  # 32 MB: the shape the kernel was written for
        # Head dim 64: 64-byte key rows, half the lanes transposing.
        (2, 300, 3, 64),
        (1, 1, 1, 64),
        (1, 4097, 2, 64),
        (16, 1024, 16, 64),
        # Head dim 256: the 128 kernel over twice the heads.
        (2, 300, 3, 256),
        (1, 1, 1, 256),
        (1, 4097, 2, 256),
        (4, 1024, 8, 256),
    ],
)
def test_kernel_is_the_pure_jax_layout_bitwise(rng, shape):
    v = random_e4m3(rng, shape, avoid=E4M3_NAN_BYTE)  # every other code, 0xFF (NaN) included
    got = run_poisoned(v)
    np.testing.assert_array_equal(got, value_operand_bytes(v))
    # The XLA fusion the kernel replaces, on the same GPU, and the CPU's pure-JAX lowering.
    np.testing.assert_array_equal(got, as_bytes(jax.jit(fp8_value_operand)(v)))
    cpu_v = jax.device_put(v, jax.devices("cpu")[0])
    np.testing.assert_array_equal(got, as_bytes(jax.jit(fp8_value_operand)(cpu_v)))


def test_fresh_inputs_give_fresh_outputs(rng):
    """Two calls of one compiled program on different inputs (no stale buffer, no caching)."""
    fn = jax.jit(fp8_value_operand_p.bind)
    for _ in range(2):
        v = random_e4m3(rng, (2, 96, 4, 128))
        np.testing.assert_array_equal(as_bytes(fn(v)), value_operand_bytes(v))


@pytest.mark.parametrize(
    "v_shape, vt_shape, message",
    [
        ((1, 32, 1, 96), (1, 1, 96, 32), "head_dim must be 64, 128 or 256, got 96"),
        ((1, 40, 2, 128), (1, 2, 128, 40), r"vt \[1, 2, 128, 40\] must be .* = \[1, 2, 128, 64\]"),
        ((32, 2, 128), (1, 2, 128, 32), "must be \\[batch, seq_k, heads_kv, head_dim\\]"),
    ],
)
def test_handler_names_what_is_wrong(v_shape, vt_shape, message):
    call = jax.ffi.ffi_call(FFI_TARGET_VALUE_OPERAND, jax.ShapeDtypeStruct(vt_shape, jnp.float8_e4m3fn))
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(call)(jnp.zeros(v_shape, jnp.float8_e4m3fn)))


def test_handler_checks_dtypes():
    call = jax.ffi.ffi_call(
        FFI_TARGET_VALUE_OPERAND, jax.ShapeDtypeStruct((1, 1, 128, 32), jnp.float8_e4m3fn)
    )
    with pytest.raises(Exception, match="v and vt must be float8_e4m3fn"):
        jax.block_until_ready(jax.jit(call)(jnp.zeros((1, 32, 1, 128), jnp.uint8)))
