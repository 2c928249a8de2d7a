"""e4m3 bit patterns of probabilities: the lean-P code formula, its exact FFMA rounding, decoding.

Lean P (docs/fp8.md): the e4m3fn code of a positive normal number grows by 8 per doubling and 2^0
has code 56 (0x38), so the code of p = 2^y is about 8 y + 56; between powers of two the three
mantissa bits interpolate 2^frac linearly. The kernel gets the code of each probability from its
raw score s with one FFMA, code = RNE(s * c1 + c0), c1 = 8 * scale_log2, c0 = 56 - 8 r for an integer
reference exponent r; adding the magic constant 1.5 * 2^23 inside the FFMA makes the float32 result
an integer whose low byte is the code. This module computes those codes bit for bit as the FFMA
did in its first form (one rounding of the exact product plus c0; the kernel now rounds to float32
first, differing by one code within 2^-17 of a half-integer: docs/fp8.md 10.7), and decodes codes
and rounds values to e4m3.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jzyfa.quantize import FP8_DTYPE, FP8_MAX

CODE_SLOPE = 8  # codes per doubling: three mantissa bits
CODE_OF_ONE = 56  # 0x38: exponent field 7 (the bias), mantissa 0
MAX_CODE = 0x7E  # 448, the largest finite e4m3fn value; 0x7F is NaN
ROUNDING_MAGIC = 12582912.0  # 1.5 * 2^23: float32 sums in [2^23, 2^24) are integers, ties to even
# |s * c1| below this is where the exact rounding is computed; larger products are far outside
# [0, MAX_CODE] for any reference exponent the emulation uses (see `fused_round_to_integer`).
_EXACT_LIMIT = 2.0**22


def _mantissa_and_exponent(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """|x| = mantissa * 2^exponent for float32 x, mantissa a uint32 < 2^24; also whether x is normal."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    exponent_field = (bits >> 23) & 0xFF
    normal = exponent_field > 0
    mantissa = jnp.where(normal, (bits & 0x7FFFFF) | 0x800000, bits & 0x7FFFFF)
    exponent = jnp.where(normal, exponent_field.astype(jnp.int32) - 150, -149)
    return mantissa, exponent, normal


def _mantissa_product(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The exact 48-bit product of two uint32 mantissas < 2^24, as (high, low): high * 2^24 + low."""
    a_hi, a_lo = a >> 12, a & 0xFFF
    b_hi, b_lo = b >> 12, b & 0xFFF
    middle = a_hi * b_lo + a_lo * b_hi  # < 2^25: every partial product of 12-bit limbs fits uint32
    low = a_lo * b_lo + ((middle & 0xFFF) << 12)  # < 2^25
    high = a_hi * b_hi + (middle >> 12) + (low >> 24)
    return high, low & 0xFFFFFF


def _compare_scaled_product(high, low, shift, m) -> jax.Array:
    """sign(P / 2^shift - m) for P = high * 2^24 + low, shift in [24, 55], m a uint32."""
    excess = jnp.clip(shift - 24, 0, 31).astype(jnp.uint32)
    quotient = high >> excess
    sticky = (low != 0) | ((high & ((jnp.uint32(1) << excess) - 1)) != 0)
    greater = (quotient > m) | ((quotient == m) & sticky)
    equal = (quotient == m) & ~sticky
    return jnp.where(greater, 1, jnp.where(equal, 0, -1))


@jax.jit
def fused_round_to_integer(s: jax.Array, c1: jax.Array, c0: jax.Array) -> jax.Array:
    """RNE(s * c1 + c0) from the exact product, as one FFMA adding c0 + ROUNDING_MAGIC gives it.

    s: float32 (finite); c1: float32 > 0; c0: float32 holding an integer with |c0| < 2^21. Returns
    float32 integers. The product s * c1 is exact only in 48 bits, and XLA may or may not contract a
    multiply and an add into an FMA, so the rounding decision is made in integer arithmetic: the
    approximate product picks the nearest integer n, and an exact comparison of 2|s c1| with the odd
    integers 2n +- 1 settles the cases where the product lies within an ulp of a half-integer (ties
    go to the even result, as the FFMA's round-to-nearest-even does). Where |s * c1| >= 2^22 the
    result is the float32 approximation, which is exact for every code the clamp to [0, 126]
    could keep, given |c0| < 2^21.
    """
    s = jnp.asarray(s, jnp.float32)
    c1 = jnp.asarray(c1, jnp.float32)
    c0 = jnp.asarray(c0, jnp.float32)
    s, c1, c0 = jnp.broadcast_arrays(s, c1, c0)
    approx = s * c1
    magnitude = jnp.abs(approx)
    nearest = jnp.round(magnitude)  # round half to even; exact for float32

    s_mantissa, s_exponent, s_normal = _mantissa_and_exponent(s)
    c_mantissa, c_exponent, c_normal = _mantissa_and_exponent(c1)
    high, low = _mantissa_product(s_mantissa, c_mantissa)
    shift = -(s_exponent + c_exponent + 1)  # 2 |s c1| = P / 2^shift

    def compare_twice_with(odd: jax.Array) -> jax.Array:  # sign(2 |s c1| - odd), odd >= -1
        m = jnp.maximum(odd, 0.0).astype(jnp.uint32)
        return jnp.where(odd < 0, 1, _compare_scaled_product(high, low, shift, m))

    above = compare_twice_with(2 * nearest + 1)  # against nearest + 1/2
    below = compare_twice_with(2 * nearest - 1)  # against nearest - 1/2
    rounded = jnp.where(above > 0, nearest + 1, jnp.where(below < 0, nearest - 1, nearest))
    sign = jnp.where(s < 0, -1.0, 1.0)
    # A tie between sign * j and sign * (j + 1): take whichever result is even.
    j = jnp.where(above == 0, nearest, nearest - 1)
    first, second = c0 + sign * j, c0 + sign * (j + 1)
    tie = jnp.where(jnp.remainder(first, 2) == 0, first, second)
    exact = jnp.where((above == 0) | (below == 0), tie, c0 + sign * rounded)

    valid = s_normal & c_normal & (magnitude >= 0.25) & (magnitude < _EXACT_LIMIT)
    # |s c1| < 1/4 lies strictly inside (-1/2, 1/2): the result is c0.
    fallback = jnp.where(magnitude < 0.25, c0, jnp.round(approx + c0))
    return jnp.where(valid, exact, fallback)


@jax.jit
def lean_codes(s: jax.Array, c1: jax.Array, c0: jax.Array) -> jax.Array:
    """uint8 e4m3 codes clamp(RNE(s * c1 + c0), 0, MAX_CODE); masked scores (s = -inf) give code 0."""
    masked = s == -jnp.inf
    code = fused_round_to_integer(jnp.where(masked, 0.0, s), c1, c0)
    code = jnp.clip(code, 0, MAX_CODE)
    return jnp.where(masked, 0, code).astype(jnp.uint8)


@jax.jit
def code_of_exponent(y: jax.Array) -> jax.Array:
    """The lean-P code of p = 2^y for float32 y: clamp(RNE(8 y + 56), 0, MAX_CODE), as uint8.

    One rounding, as FFMA(y, 8, 56 + magic) does: rounding 8 y + 56 to float32 first and then to an
    integer would differ where the sum lies within an ulp of a half-integer.
    """
    return lean_codes(y, jnp.float32(CODE_SLOPE), jnp.float32(CODE_OF_ONE))


@jax.jit
def decode(codes: jax.Array) -> jax.Array:
    """float32 values of uint8 e4m3fn bit patterns."""
    return lax.bitcast_convert_type(jnp.asarray(codes, jnp.uint8), FP8_DTYPE).astype(jnp.float32)


@jax.jit
def round_to_e4m3(x: jax.Array) -> jax.Array:
    """Nearest e4m3fn value (ties to even, subnormals kept), saturating at 448, as float32.

    The kernel's `cvt.rn.satfinite.e4m3x2.f32`; x >= 0 here. Computed with float32 arithmetic and
    `reduce_precision` rather than a round trip through float8: XLA's GPU backend may drop such a
    round trip (excess precision) in some consumers of the result and keep it in others, which made
    the emulation's O and row sums disagree there.
    """
    x = jnp.clip(x, 0.0, FP8_MAX)
    # Normal range: three mantissa bits (five exponent bits keep 2^-6 .. 448 normal and finite).
    normal = lax.reduce_precision(x, exponent_bits=5, mantissa_bits=3)
    # Below 2^-6 e4m3fn is subnormal: multiples of 2^-9 (jnp.round ties to even; the scalings are exact).
    subnormal = jnp.round(x * 2.0**9) * 2.0**-9
    return jnp.where(x < 2.0**-6, subnormal, normal)
