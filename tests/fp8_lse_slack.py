"""How far an FP8 kernel's LSE may lie from its emulation's, row by row, because of rounding ties.

The kernel rounds each probability to e4m3 (exact P: cvt.rn of 2^(t - r); lean P: RNE of the code
8 (t - r) + 56), and its row sum adds the rounded values. Its scores t come from QGMMA, whose
accumulator keeps fewer bits than float32 (docs/fp8.md), while the emulation's are exact. Where a
probability lies within that score error of a rounding tie the two may round it to neighbouring
e4m3 values, one step apart; in a row that sees a few keys a single such step of its largest
probability moves the LSE by up to ln(1 + 1/8) (seen: 5 keys, 92.0014 -> 88 or 96, 0.064).

`lse_rounding_slack` bounds that per row: -ln(1 - m / l), m the sum of the steps of the near-tie
probabilities and l the row sum (either neighbour may be the emulation's). Rows with no probability near a tie get 0, so they are held to float32 noise.
"""

import math

import numpy as np

from jzyfa import _validation, reference
from jzyfa.fp8_emulation import BLOCK_N, scale_log2

# QGMMA's score error, relative to sum_i |q_i k_i| (generous: the accumulator keeps ~14 bits).
SCORE_ERROR = 2.0**-14
_E4M3_MIN_NORMAL_EXPONENT = -6
_E4M3_MAX = 448.0
_ROWS_PER_CHUNK = 256  # float64 [rows, Sk] temporaries per head stay small at 8K keys


def _per_head(descale, batch: int, heads_q: int) -> np.ndarray:
    """A () / (1,) / [B, Hkv] descale as float64 [B, Hq]."""
    d = np.asarray(descale, np.float64)
    if d.ndim < 2:
        return np.full((batch, heads_q), float(d.reshape(-1)[0]))
    return np.repeat(d, heads_q // d.shape[1], axis=1)


def _steps_at_ties(y: np.ndarray, err: np.ndarray, lean_p: bool) -> np.ndarray:
    """For P~ = 2^y: one e4m3 step where y lies within err of a rounding tie, else 0."""
    if lean_p:  # the code 8 y + 56 is rounded to an integer: ties at half-integers
        z = 8.0 * y + 56.0
        near = np.abs(z - np.floor(z) - 0.5) <= 8.0 * err
        code = np.clip(np.floor(z), 0, 0x7D)
        step = _e4m3_value(code + 1) - _e4m3_value(code)
    else:  # 2^y rounded to three mantissa bits (subnormals below 2^-6 on a fixed grid)
        x = np.exp2(y)
        exponent = np.maximum(np.floor(y), _E4M3_MIN_NORMAL_EXPONENT)
        step = np.exp2(exponent - 3)
        units = x / step
        near = (np.abs(units - np.floor(units) - 0.5) <= units * math.log(2.0) * err) & (x < _E4M3_MAX)
    return np.where(near, step, 0.0)


def _e4m3_value(code: np.ndarray) -> np.ndarray:
    """Values of non-negative e4m3fn codes 0..0x7E."""
    exponent_field, mantissa = np.floor(code / 8), np.mod(code, 8)
    normal = np.exp2(exponent_field - 7) * (1 + mantissa / 8)
    return np.where(exponent_field == 0, np.exp2(-6) * mantissa / 8, normal)


def lse_rounding_slack(
    q8,
    k8,
    descales,
    emu_lse,
    reference_exponent,
    *,
    causal,
    lean_p,
    window=None,
    softmax_scale=None,
    block_n=BLOCK_N,
) -> np.ndarray:
    """float64 [B, Hq, Sq]: the LSE difference, kernel vs emulation, that rounding ties can explain.

    reference_exponent: the emulation trace's r per row and key block [B, Hq, Sq, blocks] (blocks of
    block_n keys, the emulation's);
    emu_lse: its LSE (natural log). Rows that see no key get 0.
    """
    q = np.asarray(q8.astype(np.float32), np.float64)
    k = np.asarray(k8.astype(np.float32), np.float64)
    batch, seq_q, heads_q, head_dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    k = np.repeat(k, heads_q // heads_kv, axis=2)  # [B, Sk, Hq, D]
    softmax_scale = _validation.resolve_softmax_scale(softmax_scale, head_dim)
    row_scale = np.asarray(
        scale_log2(
            softmax_scale,
            _per_head(descales[0], batch, heads_q).astype(np.float32),
            _per_head(descales[1], batch, heads_q).astype(np.float32),
        ),
        np.float64,
    )  # [B, Hq]
    mask = _validation.mask_window(bool(causal), _validation.check_window(window))
    keys = np.arange(seq_k)
    reference_exponent = np.asarray(reference_exponent, np.float64)
    emu_lse = np.asarray(emu_lse, np.float64)
    slack = np.zeros((batch, heads_q, seq_q))
    for b in range(batch):
        for h in range(heads_q):
            for start in range(0, seq_q, _ROWS_PER_CHUNK):
                rows = np.arange(start, min(seq_q, start + _ROWS_PER_CHUNK))
                visible = np.asarray(
                    reference.window_visible(rows[:, None] + (seq_k - seq_q), keys[None, :], mask)
                )
                t = (q[b, rows, h] @ k[b, :, h].T) * row_scale[b, h]
                err = SCORE_ERROR * (np.abs(q[b, rows, h]) @ np.abs(k[b, :, h]).T) * row_scale[b, h]
                r_per_key = reference_exponent[b, h, rows][:, keys // block_n]
                r_final = reference_exponent[b, h, rows, -1]
                with np.errstate(invalid="ignore", over="ignore"):
                    steps = _steps_at_ties(t - r_per_key, err, lean_p)
                    # In units of the row's final reference, as its row sum l = 2^(lse log2 e - r).
                    moved = np.where(visible, steps * np.exp2(r_per_key - r_final[:, None]), 0.0).sum(axis=1)
                    row_sum = np.exp2(emu_lse[b, h, rows] / math.log(2.0) - r_final)
                    # The emulation's sum may hold the upper neighbours: -ln(1 - m/l) >= ln(1 + m/l).
                    bound = np.where(moved < row_sum, -np.log1p(-moved / row_sum), np.inf)
                    slack[b, h, rows] = np.where(np.isfinite(r_final), bound, 0.0)
    return slack
