"""Per-pipe instruction budget of one key block of an FP8 (or 16-bit) attention kernel, read from its SASS.

Walks the common path of the consumer loop's steady-state iteration, from the turn that issues a block's
Q K^T to the next one: no mask, no promotion of O, no rescale, no change of the reference exponent
(the rare paths, recognised by what they contain), and counts its instructions per warp by pipe. With
the issue rate and the per-pipe rates measured on the H200 (docs/fp8.md 10.25) that gives SM cycles per
block step (two consumer warpgroups), to set against the tensor cores' cycles (docs/fp8.md 6, 10.32).

    cuobjdump --dump-sass -fun <kernel symbol> _jzyfa_ffi*.so > kernel.sass
    python tools/sass_budget.py kernel.sass --block_n 192 [--dtype bf16]
"""

from __future__ import annotations

import argparse
import collections
import re
from dataclasses import dataclass

# Thread-instructions per SM per clock on the H200 (docs/fp8.md 10.25: FFMA 117, FMNMX/PRMT/IMAD 62-64,
# MUFU.EX2 16, F2FP e4m3x2 31.5); the other ALU instructions are taken at the FMNMX rate.
PIPE_RATES = {"fma": 117.0, "imad": 64.0, "alu": 64.0, "xu": 16.0, "f2fp": 31.5}
_PIPES = {
    "fma": {"FFMA", "FMUL", "FADD"},
    "imad": {"IMAD"},
    "xu": {"MUFU", "FRND", "F2I", "I2F"},
    "f2fp": {"F2FP"},
    "alu": {"FMNMX", "FSEL", "FSETP", "ISETP", "LOP3", "PRMT", "SEL", "PLOP3", "IADD3", "VIADD", "LEA",
            "SHF", "CS2R", "MOV", "IMNMX"},
    "tensor": {"QGMMA", "HGMMA"},
}


@dataclass(frozen=True)
class Instruction:
    address: int
    text: str

    @property
    def opcode(self) -> str:
        """The mnemonic with its modifiers, without the predicate (`FFMA.SAT`, `BRA`)."""
        return re.sub(r"^@!?U?P\w+\s+", "", self.text).split()[0]

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def branch_target(self) -> int | None:
        if self.base != "BRA":
            return None
        match = re.search(r"(0x[0-9a-f]+)\s*$", self.text)
        return int(match.group(1), 16) if match else None

    @property
    def conditional(self) -> bool:
        return self.text.startswith("@")


def parse(sass: str) -> list[Instruction]:
    """cuobjdump's `/*addr*/ INSTRUCTION ;` lines of one kernel, in order."""
    found = re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;/]*?)\s*;", sass)
    return [Instruction(int(m.group(1), 16), m.group(2).strip()) for m in found]


def pipe(instruction: Instruction) -> str:
    base = instruction.base
    for name, members in _PIPES.items():
        if base in members:
            return name
    if base.startswith("U") or base in ("R2UR", "VOTEU"):
        return "uniform"
    return "other"


def rare(region: list[Instruction]) -> bool:
    """Code the common path skips: the mask (many FSEL), O's promotion or the copy's fold (shared
    memory), a rescale of O (many FMUL), a moved reference exponent (F2I), a slow-path call."""
    ops = collections.Counter(i.base for i in region)
    shared_memory = ops["LDS"] + ops["STS"] > 0
    return shared_memory or ops["FSEL"] >= 16 or ops["FMUL"] >= 16 or ops["F2I"] > 0 or ops["CALL"] > 0


def common_iteration(instructions: list[Instruction], qk_shape: str) -> list[Instruction]:
    """The instructions of the loop's steady-state iteration on its common path: from the second turn
    that issues Q K^T (`qk_shape`, e.g. "QGMMA.64x192x32", the first being block 0's) up to the next.
    A forward conditional branch is taken when the code it skips is rare (and holds no Q K^T: that is
    the loop going on); everything else falls through."""
    index = {ins.address: k for k, ins in enumerate(instructions)}
    is_qk = [qk_shape in ins.opcode for ins in instructions]
    # A group: Q K^T's k-steps, with no other wgmma or barrier between them.
    qk_starts, previous_qk = [], False
    for k, ins in enumerate(instructions):
        if is_qk[k]:
            if not previous_qk:
                qk_starts.append(k)
            previous_qk = True
        elif ins.base in ("QGMMA", "HGMMA", "BAR"):
            previous_qk = False
    if len(qk_starts) < 2:
        raise ValueError(f"fewer than two {qk_shape} groups: not a consumer loop")
    # An iteration starts at its turn: back from its Q K^T to the turn's barrier (BAR.SYNC).
    def turn(start: int) -> int:
        while start > 0 and instructions[start].base != "BAR":
            start -= 1
        return start

    turns = {turn(k) for k in qk_starts}
    k = turn(qk_starts[1])
    path, visited = [], set()
    while k < len(instructions):
        if path and k in turns:
            break  # the next iteration's turn
        if k in visited:
            raise ValueError(f"the walk came back to {instructions[k].address:#x} before the next turn")
        visited.add(k)
        ins = instructions[k]
        path.append(ins)
        target = ins.branch_target
        if target is not None and target in index:
            t = index[target]
            if not ins.conditional:
                k = t
                continue
            skipped = instructions[k + 1 : t] if t > k else []
            if skipped and not any(is_qk[k + 1 : t]) and rare(skipped):
                k = t
                continue
        if ins.base == "EXIT":
            break
        k += 1
    return path  # one period: the next iteration's K wait (before its turn) included


# Dense wgmma FLOP per SM per clock, and the columns P V adds to O's (FP8: the row-sum columns).
TENSOR_RATES = {"fp8": 8192, "bf16": 4096}
SUM_COLUMNS = {"fp8": 8, "bf16": 0}


def budget(path: list[Instruction], block_n: int, head_dim: int = 128, warps: int = 8, dtype: str = "fp8") -> dict:
    """Per-warp counts by pipe and SM cycles per block step (`warps` consumer warps, two warpgroups)."""
    counts = collections.Counter(pipe(i) for i in path)
    pv_n = head_dim + SUM_COLUMNS[dtype]
    tensor = 2 * (64 * block_n * head_dim * 2 + 64 * pv_n * block_n * 2) / TENSOR_RATES[dtype]
    cycles = {p: counts[p] * warps * 32 / rate for p, rate in PIPE_RATES.items()}
    return {
        "instructions": len(path),
        "counts": dict(counts),
        "opcodes": collections.Counter(i.base for i in path),
        "issue_per_scheduler": len(path) * warps // 4,
        "pipe_cycles": cycles,
        "tensor_cycles": tensor,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sass", help="cuobjdump --dump-sass output of one kernel")
    parser.add_argument("--block_n", type=int, default=128, help="keys per block (the Q K^T's N)")
    parser.add_argument("--dtype", choices=sorted(TENSOR_RATES), default="fp8")
    parser.add_argument("--qk_shape", default=None,
                        help="default QGMMA.64x<block_n>x32 (fp8), HGMMA.64x<block_n>x16 (bf16)")
    args = parser.parse_args(argv)
    with open(args.sass) as f:
        instructions = parse(f.read())
    default_shape = f"QGMMA.64x{args.block_n}x32" if args.dtype == "fp8" else f"HGMMA.64x{args.block_n}x16"
    path = common_iteration(instructions, args.qk_shape or default_shape)
    result = budget(path, args.block_n, dtype=args.dtype)
    print(f"{result['instructions']} instructions per warp per {args.block_n}-key block "
          f"({result['instructions'] / args.block_n:.2f} per key), from {path[0].address:#x} to {path[-1].address:#x}")
    print(f"tensor cycles per block step (two consumers): {result['tensor_cycles']:.0f}")
    print(f"issue cycles per scheduler (two consumer warps): {result['issue_per_scheduler']}")
    for name, cycles in result["pipe_cycles"].items():
        print(f"  {name:5s} {result['counts'].get(name, 0):4d} per warp -> {cycles:6.0f} SM cycles")
    print("  uniform", result["counts"].get("uniform", 0), " other", result["counts"].get("other", 0),
          " tensor", result["counts"].get("tensor", 0))
    print("  " + ", ".join(f"{op} {n}" for op, n in result["opcodes"].most_common(16)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
