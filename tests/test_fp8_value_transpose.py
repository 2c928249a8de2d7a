"""The FP8 kernel's in-kernel V transpose (ffi/fp8_value_transpose.cuh: `Fp8TransposeLane`,
`Transpose4x4Rotated`, `TransposeValuePiece`, called by `FlashFwdFp8Tiles`' warps 1..3), simulated lane
by lane in NumPy: what each transposing lane reads from the staging buffer (V's tile as TMA loads it,
[128 keys][128 bytes], unswizzled), which bytes its PRMTs pick, and where its 128-bit stores land in the
stage's V^T tile. De-swizzled (16-byte chunk c of row n at chunk c ^ (n % 8): the 128-byte swizzle the
consumers' SmemDescSw128 descriptors read), the tile must be `fp8_layout.fp8_value_operand` of the same
V tile, byte for byte, with every byte written exactly once; and no shared-memory access may conflict.

The simulation's constants are the kernel's (`lane_word`, `lane_rot`, `selector`, the piece order); the
first test reads them back out of the header, so the two cannot drift apart silently.
"""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jzyfa.fp8_layout import fp8_value_operand

HEADER = pathlib.Path(__file__).resolve().parents[1] / "ffi" / "fp8_value_transpose.cuh"

KEYS = 128  # Fp8ValueTranspose::kKeys
HEAD_DIM = 128  # Fp8ValueTranspose::kHeadDim: bytes per key row, V^T rows
PIECE_KEYS = 16  # Fp8ValueTranspose::kPieceKeys
PIECES = KEYS // PIECE_KEYS
WARPS = 3  # Fp8ValueTranspose::kWarps: warp t takes pieces t, t + 3, t + 6


def lane_word(lane: int) -> int:
    """Fp8TransposeLane::word: (lane & 24) | ((lane & 3) << 1) | ((lane >> 2) & 1)."""
    return (lane & 24) | ((lane & 3) << 1) | ((lane >> 2) & 1)


def lane_rot(lane: int) -> int:
    """Fp8TransposeLane::rot."""
    return lane & 3


def selector(b: int) -> int:
    """Fp8TransposeLane::Selector(b): x.b, y.b, x.(b + 1), y.(b + 1) (mod 4)."""
    b1 = (b + 1) & 3
    return b | ((b + 4) << 4) | (b1 << 8) | ((b1 + 4) << 12)


def byte_perm(x: int, y: int, s: int) -> int:
    """CUDA's __byte_perm (PRMT, default mode) for selectors whose nibbles are 0..7."""
    pool = (y << 32) | x
    return sum(((pool >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def transpose4x4_rotated(w: list[int], lane: int) -> list[int]:
    """Transpose4x4Rotated: rows[k] = byte (k + rot) % 4 of w0..w3."""
    lo, hi = selector(lane_rot(lane)), selector((lane + 2) & 3)
    lo01, hi01 = byte_perm(w[0], w[1], lo), byte_perm(w[0], w[1], hi)
    lo23, hi23 = byte_perm(w[2], w[3], lo), byte_perm(w[2], w[3], hi)
    return [
        byte_perm(lo01, lo23, 0x5410),
        byte_perm(lo01, lo23, 0x7632),
        byte_perm(hi01, hi23, 0x5410),
        byte_perm(hi01, hi23, 0x7632),
    ]


def simulate(staging: np.ndarray):
    """The V^T tile's shared-memory bytes after warps 1..3 ran, how often each byte was written, and
    the address lists of every LDS.32 and STS.128 warp instruction (for the bank checks)."""
    stage = staging.reshape(-1)
    smem = np.zeros(HEAD_DIM * KEYS, np.uint8)
    writes = np.zeros(HEAD_DIM * KEYS, np.int64)
    loads, stores = [], []
    for warp in range(WARPS):
        for piece in range(warp, PIECES, WARPS):
            w = np.zeros((32, PIECE_KEYS), np.int64)
            for j in range(PIECE_KEYS):
                first = piece * PIECE_KEYS * HEAD_DIM + j * HEAD_DIM  # key row 16 piece + j
                addrs = [first + 4 * lane_word(lane) for lane in range(32)]
                loads.append(addrs)
                for lane, a in enumerate(addrs):
                    w[lane, j] = int.from_bytes(stage[a : a + 4].tobytes(), "little")
            chunk_words = np.zeros((32, 4, 4), np.int64)  # [lane][word i][store k]
            for lane in range(32):
                for i in range(4):
                    quad = [int(w[lane, j]) for j in (2 * i, 2 * i + 1, 2 * i + 8, 2 * i + 9)]
                    chunk_words[lane, i] = transpose4x4_rotated(quad, lane)
            for k in range(4):
                addrs = []
                for lane in range(32):
                    row = 4 * lane_word(lane) + ((k + lane_rot(lane)) & 3)
                    a = row * 128 + ((piece ^ (row & 7)) << 4)
                    addrs.append(a)
                    data = b"".join(int(chunk_words[lane, i, k]).to_bytes(4, "little") for i in range(4))
                    smem[a : a + 16] = np.frombuffer(data, np.uint8)
                    writes[a : a + 16] += 1
                stores.append(addrs)
    return smem, writes, loads, stores


def deswizzle(smem: np.ndarray) -> np.ndarray:
    """[128 rows][128 keys] from the 128-byte-swizzled tile (as TMA would have written V^T)."""
    out = np.zeros((HEAD_DIM, KEYS), np.uint8)
    for n in range(HEAD_DIM):
        for c in range(8):
            p = c ^ (n % 8)
            out[n, 16 * c : 16 * c + 16] = smem[n * 128 + 16 * p : n * 128 + 16 * p + 16]
    return out


def test_constants_are_the_kernels():
    text = HEADER.read_text()
    assert "word((lane & 24u) | ((lane & 3u) << 1) | ((lane >> 2) & 1u))" in text
    assert "rot(lane & 3u)" in text
    assert "sel_lo(Selector(lane & 3u))" in text and "sel_hi(Selector((lane + 2u) & 3u))" in text
    assert "return b | ((b + 4u) << 4) | (b1 << 8) | ((b1 + 4u) << 12);" in text
    assert re.search(r"kPieceKeys = 16;", text) and re.search(r"kWarps = 3;", text)
    assert "const uint32_t row = 4u * lane.word + ((k + lane.rot) & 3u);" in text
    assert "row * 128u + ((piece ^ (row & 7u)) << 4)" in text
    assert "Transpose4x4Rotated(w[2 * i], w[2 * i + 1], w[2 * i + 8], w[2 * i + 9], lane, words[i]);" in text
    kernel = (HEADER.parent / "flash_fwd_fp8_kernel.cuh").read_text()
    assert "piece += Fp8ValueTranspose::kWarps" in kernel and "threadIdx.x / 32 - 1" in kernel
    # rot = 0 is the plain 4 x 4 transpose (ffi/fp8_value_operand.cu's, before this kernel took it over).
    assert selector(0) == 0x5140 and selector(2) == 0x7362
    assert sorted(lane_word(lane) for lane in range(32)) == list(range(32))


def assert_builds_the_value_operand(simulate_lanes, seed: int) -> None:
    """simulate_lanes(V tile) -> (smem, writes, ...) of a transposer: the de-swizzled V^T tile is
    fp8_value_operand of random V bytes, every byte written exactly once."""
    rng = np.random.default_rng(seed)
    tile = rng.integers(0, 256, (KEYS, HEAD_DIM), dtype=np.uint8)  # [key][head-dim byte], any bytes
    smem, writes, _, _ = simulate_lanes(tile)
    assert np.all(writes == 1), "every V^T byte written exactly once (none left uninitialized)"
    v = jnp.asarray(tile.reshape(1, KEYS, 1, HEAD_DIM)).view(jnp.float8_e4m3fn)
    want = np.asarray(fp8_value_operand(v).view(jnp.uint8))[0, 0]  # [128, 128]
    np.testing.assert_array_equal(deswizzle(smem), want)


@pytest.mark.parametrize("seed", [0, 1])
def test_transpose_builds_the_value_operand(seed):
    assert_builds_the_value_operand(simulate, seed)


def test_shared_memory_accesses_are_conflict_free():
    _, _, loads, stores = simulate(np.zeros((KEYS, HEAD_DIM), np.uint8))
    for addrs in loads:  # LDS.32: 32 lanes, one wavefront if the 32 banks differ
        assert len({(a // 4) % 32 for a in addrs}) == 32
    for addrs in stores:  # STS.128: four phases of 8 lanes, each must cover the 32 banks once
        for phase in range(4):
            chunks = {(a // 16) % 8 for a in addrs[8 * phase : 8 * phase + 8]}
            assert len(chunks) == 8
    assert len(loads) == PIECES * PIECE_KEYS and len(stores) == PIECES * 4
