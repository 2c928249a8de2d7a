"""The FP8 kernel's matrix-instruction V transpose (ffi/fp8_value_transpose.cuh: `Fp8MatrixTransposeLane`
and its `TransposeValuePiece`, the default; -DJZYFA_FP8_V_TRANSPOSE_LDSM=0 builds the PRMT one), simulated lane by lane in
NumPy: TMA's 128-byte swizzle of the staging tile, `ldmatrix.m8n8.x4.trans.b16` (lane 8 i + l gives
the address of row l of matrix i; transposed, lane t receives from matrix i the 16-bit elements (row
2 (t % 4), column t / 4) and (row 2 (t % 4) + 1, column t / 4), the first in the low half),
`__byte_perm`, and `stmatrix.m8n8.x4.b16` (lane t holds word t % 4 of row t / 4 of each matrix; lane
8 j + r gives the address of row r of matrix j). De-swizzled, the V^T tile must be
`fp8_layout.fp8_value_operand` of the same V tile, byte for byte, every byte written once, and every
matrix's 8 rows must fall in 8 different 16-byte bank groups (conflict-free).

The lane constants are the header's formulas, transcribed; the first test reads them back out of the
header so that the two cannot drift apart silently.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_fp8_value_transpose import (
    HEADER,
    PIECE_KEYS,
    PIECES,
    WARPS,
    assert_builds_the_value_operand,
    byte_perm,
)

KEYS = HEAD_DIM = 128


def load_offset(lane: int) -> int:
    """Fp8MatrixTransposeLane::load_offset (quarter 0; quarter q's is its XOR (q << 5))."""
    matrix, row = lane // 8, lane % 8
    return (8 * (matrix & 1) + row) * 128 + ((((matrix // 2) ^ row) & 1) << 4) + ((row // 2) << 5)


def store_row(lane: int) -> int:
    """The V^T row (quarter 0) whose address the lane gives to stmatrix: store_offset / 128."""
    matrix, row = lane // 8, lane % 8
    return 16 * (matrix // 2) + 2 * row + ((matrix & 1) ^ (1 if row >= 4 else 0))


def selectors(lane: int) -> tuple[int, int]:
    """(sel_even, sel_odd)."""
    return (0x6420, 0x7531) if lane < 16 else (0x7531, 0x6420)


def swizzle(tile: np.ndarray) -> np.ndarray:
    """TMA's SWIZZLE_128B of a [rows][128 bytes] tile at a 1024-aligned address: flat bytes."""
    out = np.zeros(tile.size, np.uint8)
    for n in range(tile.shape[0]):
        for c in range(8):
            p = c ^ (n % 8)
            out[n * 128 + 16 * p : n * 128 + 16 * p + 16] = tile[n, 16 * c : 16 * c + 16]
    return out


def ldmatrix_x4_trans(smem: np.ndarray, addrs: list[int]) -> np.ndarray:
    """uint32 [32 lanes][4 matrices]: what ldmatrix.m8n8.x4.trans.b16 gives each lane."""
    rows = [smem[a : a + 16].view(np.uint16) for a in addrs]  # rows[8 i + l]: row l of matrix i
    out = np.zeros((32, 4), np.int64)
    for t in range(32):
        for i in range(4):
            lo = int(rows[8 * i + 2 * (t % 4)][t // 4])
            hi = int(rows[8 * i + 2 * (t % 4) + 1][t // 4])
            out[t, i] = lo | (hi << 16)
    return out


def stmatrix_x4(smem, writes, addrs: list[int], regs: np.ndarray) -> None:
    """stmatrix.m8n8.x4.b16: row r of matrix j (lane 8 j + r's address) gets words regs[4 r + w, j]."""
    for j in range(4):
        for r in range(8):
            a = addrs[8 * j + r]
            data = b"".join(int(regs[4 * r + w, j]).to_bytes(4, "little") for w in range(4))
            smem[a : a + 16] = np.frombuffer(data, np.uint8)
            writes[a : a + 16] += 1


def simulate(tile: np.ndarray):
    """V^T tile bytes, write counts, and every LDSM / STSM's address list, after warps 1..3 ran."""
    staging = swizzle(tile)
    smem = np.zeros(HEAD_DIM * KEYS, np.uint8)
    writes = np.zeros(HEAD_DIM * KEYS, np.int64)
    loads, stores = [], []
    for warp in range(WARPS):
        for piece in range(warp, PIECES, WARPS):
            src = piece * PIECE_KEYS * HEAD_DIM
            for q in range(4):
                addrs = [(src + load_offset(lane)) ^ (q << 5) for lane in range(32)]
                loads.append(addrs)
                m = ldmatrix_x4_trans(staging, addrs)
                regs = np.zeros((32, 4), np.int64)
                for t in range(32):
                    even, odd = selectors(t)
                    regs[t] = [
                        byte_perm(int(m[t, 0]), int(m[t, 1]), even),
                        byte_perm(int(m[t, 0]), int(m[t, 1]), odd),
                        byte_perm(int(m[t, 2]), int(m[t, 3]), even),
                        byte_perm(int(m[t, 2]), int(m[t, 3]), odd),
                    ]
                addrs = []
                for lane in range(32):
                    row = store_row(lane)
                    addrs.append(row * 128 + ((piece ^ (row % 8)) << 4) + q * 32 * 128)
                stores.append(addrs)
                stmatrix_x4(smem, writes, addrs, regs)
    return smem, writes, loads, stores


def test_constants_are_the_kernels():
    text = " ".join(HEADER.read_text().split())  # whitespace-insensitive (line breaks)
    assert (
        "load_offset = (8u * (matrix & 1u) + row) * 128u + ((((matrix / 2u) ^ row) & 1u) << 4) + "
        "((row / 2u) << 5);" in text
    )
    assert "vt_row = 16u * (matrix / 2u) + 2u * row + ((matrix & 1u) ^ (row >= 4u ? 1u : 0u));" in text
    assert "sel_even = lane < 16u ? 0x6420u : 0x7531u;" in text
    assert "sel_odd = lane < 16u ? 0x7531u : 0x6420u;" in text
    assert "LoadMatrixX4Trans((src + lane.load_offset) ^ (q << 5), m[q]);" in text
    assert "vt + lane.store_offset + ((piece ^ lane.store_row_mod8) << 4);" in text
    assert "StoreMatrixX4(dst + q * 32u * 128u, __byte_perm(m[q][0], m[q][1], lane.sel_even)," in text
    # The matrix instructions' wrappers (ffi/sm90_mma.cuh: StoreMatrixX4 serves the backward's gradient
    # stores too).
    wrappers = " ".join((HEADER.parent / "sm90_mma.cuh").read_text().split()) + " " + text
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in wrappers
    assert "stmatrix.sync.aligned.m8n8.x4.shared.b16" in wrappers
    # Every lane supplies a 16-byte aligned row address, the 32 (matrix, row) pairs distinct.
    assert all(load_offset(lane) % 16 == 0 for lane in range(32))
    assert len({store_row(lane) for lane in range(32)}) == 32


@pytest.mark.parametrize("seed", [0, 1])
def test_matrix_transpose_builds_the_value_operand(seed):
    assert_builds_the_value_operand(simulate, seed)


def test_matrix_accesses_are_conflict_free():
    _, _, loads, stores = simulate(np.zeros((KEYS, HEAD_DIM), np.uint8))
    for addrs in loads + stores:  # per matrix, 8 rows of 16 bytes: 8 different bank groups
        for matrix in range(4):
            rows = addrs[8 * matrix : 8 * matrix + 8]
            assert len({(a // 16) % 8 for a in rows}) == 8
    assert len(loads) == len(stores) == PIECES * 4
