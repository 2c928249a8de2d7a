"""`jzyfa.dot_product_attention`: a drop-in for `jax.nn.dot_product_attention`.

Same signature, layouts ([B, T, N, H] or unbatched [T, N, H]), GQA, masking conventions (jax.nn's
causal mask is aligned top-left: query i sees key j iff j <= i), return dtype and errors. A call is
served by `jzyfa.flash_attention` where that computes exactly the same thing, and by
`jax.nn.dot_product_attention` itself otherwise (a bias, a general mask, a mask jzyfa's bottom-right
windows cannot express).

Mapping, from the definitions. jzyfa: query i sits at p = i + S - T and sees key j iff
p - left <= j <= p + right (-1: unbounded). jax.nn: query i sees key j iff i - L <= j <= i + R
(local_window_size=(L, R), an int w meaning (w, w)), and j <= i when causal. Writing d = S - T, the
jax.nn window is jzyfa's (L + d, R - d); causal is R = 0, with L unbounded. Each side maps when it is
unbounded or when the shifted bound is >= 0. jax.nn reads every integer literally (a side of -1
excludes the diagonal), jzyfa reads -1 as unbounded: a shifted bound < 0 (causal with T < S, say)
has no jzyfa equivalent and falls back.

On a CUDA GPU where jzyfa's kernel does not run but cuDNN's fused attention does (`jzyfa.cudnn`), a
call is first offered to jax.nn's own cuDNN implementation, with jax.nn's semantics as they are (bias,
mask and top-left causal masks included): jax.nn refuses at trace time what cuDNN cannot serve, and
such calls continue below.

Sequence lengths map to flash_attention's seqlens_q/seqlens_k, whose mask is aligned bottom-right
per sequence (query t at t + len_k[b] - len_q[b]). Without a causal mask or window the alignment does
not matter, so any lengths map. With one, the shift len_k[b] - len_q[b] must be zero for every
sequence, which is known at trace time only when both lengths are the same array object and T == S;
otherwise the call falls back. Padded query rows (t >= query_seq_lengths[b]) are 0 on both.

return_residual=True returns (out, residual) as jax.nn does: the log-sum-exp of each row's scaled,
masked logits ([B, T, N], or [T, N] unbatched) in the inputs' dtype, gradient-stopped. jzyfa serves it
from its own LSE; a row that sees no key (a padded query row, a window with no key in range) gets the
value jax.nn's XLA path gives it, the logsumexp of its logits all set to jax.nn's large negative
number (that number, in float32; -inf once cast to float16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jzyfa import _platform, cudnn
from jzyfa.api import flash_attention

_JAX_IMPLEMENTATIONS = ("xla", "cudnn")
# What jax.nn.dot_product_attention(implementation="cudnn") raises at trace time for a call cuDNN cannot
# serve (a dtype, head dim or window it lacks; ValueError, NotImplementedError) or where cuDNN is missing
# (RuntimeError "cuDNN is not detected."); the arguments themselves were checked already.
CUDNN_REFUSALS = (NotImplementedError, ValueError, RuntimeError)


def _is_cudnn_refusal(error: Exception) -> bool:
    """A refusal jzyfa answers with another implementation; any other RuntimeError propagates."""
    # NotImplementedError is a RuntimeError: test the refusals by name first.
    return isinstance(error, (NotImplementedError, ValueError)) or "cuDNN" in str(error)


def _shifted(bound: int | None, shift: int) -> int | None:
    """jax.nn's window side `bound` (None: unbounded; any integer is a literal bound, a negative one
    included) as a jzyfa side after adding `shift`: -1 for unbounded, None where jzyfa cannot express
    it (a bound that becomes negative, since jzyfa reads -1 as unbounded)."""
    if bound is None:
        return -1
    value = bound + shift
    return value if value >= 0 else None


def jzyfa_window(
    t: int, s: int, is_causal: bool, local_window_size: tuple[int, int] | None
) -> tuple[int, int] | None | bool:
    """The jzyfa `window` equal to jax.nn's causal mask and local window for T queries and S keys:
    False where no mask is needed, None where jzyfa's bottom-right window cannot express it."""
    left, right = (None, None) if local_window_size is None else local_window_size
    if is_causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return False
    d = s - t
    jl, jr = _shifted(left, d), _shifted(right, -d)
    if jl is None or jr is None:
        return None
    return (jl, jr)


def _zero_padded_rows(out: jax.Array, query_seq_lengths) -> jax.Array:
    """out ([B, T, N, H] or [T, N, H]) with the rows past each sequence's query length set to 0, as
    jax.nn's XLA implementation and jzyfa give them (cuDNN's are not specified)."""
    lengths = jnp.asarray(query_seq_lengths).reshape(-1)
    batched = out.reshape((lengths.shape[0], -1) + out.shape[-2:])
    rows = jnp.arange(batched.shape[1])[None, :] < lengths[:, None]
    return jnp.where(rows[:, :, None, None], batched, jnp.zeros((), out.dtype)).reshape(out.shape)


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`jax.nn.dot_product_attention`, with its signature and semantics, on jzyfa's kernels where
    they compute the same thing (see the module docstring for the mapping).

    implementation: None serves the call with jax.nn's cuDNN implementation on CUDA GPUs without
    jzyfa's kernel where cuDNN takes it, else with `jzyfa.flash_attention` where it maps (a Hopper
    kernel, cuDNN or its pure-JAX path) and with jax.nn's default elsewhere; "xla" and "cudnn" are
    passed straight to `jax.nn.dot_product_attention`.

    return_residual: also return the log-sum-exp residual (see the module docstring), as jax.nn does.
    """
    reference = functools.partial(
        jax.nn.dot_product_attention,
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        # Passed only when asked, so that the plain call stays the one every jax.nn release takes.
        **({"return_residual": True} if return_residual else {}),
    )
    if implementation in _JAX_IMPLEMENTATIONS:
        return reference(implementation=implementation)
    if implementation is not None:
        raise ValueError(
            f"implementation must be None, 'xla' or 'cudnn' (as for jax.nn.dot_product_attention), "
            f"got implementation={implementation!r}; pass None to let jzyfa choose."
        )
    # jax.nn's own checks (shapes, dtypes, lengths, heads) and its outputs' shapes and dtypes, abstractly.
    out_aval = jax.eval_shape(reference)
    residual_aval = None
    if return_residual:
        out_aval, residual_aval = out_aval
    if cudnn.replaces_kernel(_platform.target()):
        try:
            out = reference(implementation="cudnn")
        except CUDNN_REFUSALS as error:
            if not _is_cudnn_refusal(error):
                raise
            # jax.nn's cuDNN checks refuse this call: jzyfa's mapping or jax.nn's default below
        else:
            residual = None
            if return_residual:
                out, residual = out
            if query_seq_lengths is not None:
                out = _zero_padded_rows(out, query_seq_lengths)
            return (out, residual) if return_residual else out
    window = None
    if bias is None and mask is None:
        q, k, v = (jnp.asarray(x) for x in (query, key, value))
        unbatched = q.ndim == 3
        if unbatched:
            q, k, v = q[None], k[None], v[None]
        t, s = q.shape[1], k.shape[1]
        lws = (local_window_size,) * 2 if isinstance(local_window_size, int) else local_window_size
        window = jzyfa_window(t, s, is_causal, lws)
        has_lengths = query_seq_lengths is not None or key_value_seq_lengths is not None
        same_alignment = query_seq_lengths is key_value_seq_lengths and t == s
        if window not in (None, False) and has_lengths and not same_alignment:
            window = None
    if window is None:
        return reference()
    result = flash_attention(
        q,
        k,
        v,
        window=None if window is False else window,
        softmax_scale=None if scale is None else float(scale),
        seqlens_q=None if query_seq_lengths is None else jnp.asarray(query_seq_lengths),
        seqlens_k=None if key_value_seq_lengths is None else jnp.asarray(key_value_seq_lengths),
        return_lse=return_residual,
    )
    out, lse = result if return_residual else (result, None)
    if unbatched:
        out = out[0]
    out = out.astype(out_aval.dtype).reshape(out_aval.shape)
    if not return_residual:
        return out
    return out, _residual(lse, residual_aval)


def _residual(lse: jax.Array, aval) -> jax.Array:
    """jzyfa's LSE (float32 [B, N, T]) as jax.nn's residual: [B, T, N] (or [T, N]) in aval's dtype,
    gradient-stopped, a row of no key at the logsumexp jax.nn's XLA path gives it."""
    no_key = jnp.asarray(-0.7 * float(jnp.finfo(jnp.float32).max), jnp.float32)  # jax.nn's masked logit
    lse = jnp.where(jnp.isneginf(lse), no_key, lse)
    residual = jnp.swapaxes(lse, 1, 2).astype(aval.dtype).reshape(aval.shape)
    return jax.lax.stop_gradient(residual)
