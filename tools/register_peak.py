#!/usr/bin/env python3
"""Where a kernel's registers peak, from nvdisasm's live-register report.

ptxas says how many bytes a kernel spills, not where its registers run out. nvdisasm -plr -lrm narrow
prints, for every SASS instruction, how many general registers are live and which. This tool reads it
for the kernels of an object or cubin whose mangled name contains --kernel and
prints, per kernel: the peak count and where it is (the instructions around each place it is
reached), and with --live the registers live at the first peak with the instruction that last wrote
each (accumulators of wgmma and float math left out unless --all): the values a loop carries through
the peak, which are what to move out of registers when a warp-specialized kernel is at its
setmaxnreg limit (docs/architecture.md: the backward's consumers at 232).

  python tools/register_peak.py build/bwd_16bit_hd128.cu.o --kernel BwdDkdvMainloopI13__nv_bfloat16
  python tools/register_peak.py x.o --kernel Lb1E --live --context 8

Object files are unpacked with cuobjdump -xelf; nvdisasm and cuobjdump are looked up on PATH, in
/usr/local/cuda/bin and in the nvidia-cuda-* pip wheels.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

# One SASS line of nvdisasm -plr: /*addr*/ instruction ... // | count columns
_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*//\s*\|\s*(\d+)\s?(.*)$")
_SECTION = re.compile(r"^//-+ (\S+)\s+-+")
# Values the math writes (and accumulators zeroed before a loop): left out of --live unless --all.
_MATH = re.compile(
    r"^(@!?P\d\s+)?(HGMMA|QGMMA|IGMMA|MUFU|FFMA|FADD|FMUL|FMNMX|FSEL|F2FP|HADD2|HMUL2|CS2R R\d+, SRZ)"
)


@dataclasses.dataclass
class Instruction:
    address: int
    text: str
    live: int  # general registers live here
    columns: str  # -lrm narrow: one column per register, ' ' where dead


def find_tool(name: str) -> str | None:
    """A CUDA tool on PATH, in the CUDA toolkit, or in the pip wheels (nvidia-cuda-*)."""
    candidates = [shutil.which(name), f"/usr/local/cuda/bin/{name}"]
    purelib = pathlib.Path(sysconfig.get_paths()["purelib"])
    candidates += [str(p) for p in sorted(purelib.glob(f"nvidia/cu*/bin/{name}"))]
    return next((c for c in candidates if c and os.path.exists(c)), None)


def cubins(path: pathlib.Path, workdir: pathlib.Path) -> list[pathlib.Path]:
    """The cubins of an object file (cuobjdump -xelf), or the cubin itself."""
    if path.suffix == ".cubin":
        return [path]
    cuobjdump = find_tool("cuobjdump")
    if cuobjdump is None:
        raise SystemExit(
            "cuobjdump not found: pip install nvidia-cuda-cuobjdump (or put the CUDA toolkit on PATH)"
        )
    subprocess.run(
        [cuobjdump, "-xelf", "all", str(path.resolve())], cwd=workdir, check=True, capture_output=True
    )
    found = sorted(workdir.glob("*.cubin"))
    if not found:
        raise SystemExit(f"{path}: no sm_90a cubin inside (was it compiled with -gencode ...code=sm_90a?)")
    return found


def parse(text: str) -> dict[str, list[Instruction]]:
    """Kernel name -> its instructions, from one nvdisasm -plr listing."""
    kernels: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in text.splitlines():
        section = _SECTION.match(line)
        if section:  # a kernel's code (.text.<name>), or another section: nothing to read there
            name = section.group(1)
            current = kernels.setdefault(name[len(".text.") :], []) if name.startswith(".text.") else None
            continue
        match = _LINE.match(line)
        if match and current is not None:
            address, instruction, live, columns = match.groups()
            # -lrm narrow: the general registers' columns, up to the next group's '|' (predicates).
            columns = columns.split("|", 1)[0]
            current.append(Instruction(int(address, 16), instruction.rstrip(" ;"), int(live), columns))
    return kernels


def listing(nvdisasm: str, cubin: pathlib.Path) -> dict[str, list[Instruction]]:
    """Kernel name -> its instructions with their live counts and register columns (-lrm narrow)."""
    out = subprocess.run(
        [nvdisasm, "-plr", "-lrm", "narrow", str(cubin)], check=True, capture_output=True, text=True
    )
    return parse(out.stdout)


def peaks(instructions: list[Instruction]) -> tuple[int, list[int]]:
    """The peak live count and the index of the first instruction of each run that reaches it."""
    top = max(i.live for i in instructions)
    starts = [
        k for k, i in enumerate(instructions) if i.live == top and (k == 0 or instructions[k - 1].live != top)
    ]
    return top, starts


def live_values(narrow: list[Instruction], address: int, every: bool) -> list[str]:
    """The registers live at `address` and the instruction that last wrote each (-lrm narrow: '^' or 'x'
    where an instruction writes a register, ':' or 'v' where it is live or read)."""
    index = next(k for k, i in enumerate(narrow) if i.address == address)
    rows = []
    for register, mark in enumerate(narrow[index].columns):
        if mark not in ":^vx":
            continue
        writer = next(
            (
                i
                for i in reversed(narrow[: index + 1])
                if register < len(i.columns) and i.columns[register] in "^x"
            ),
            None,
        )
        text = writer.text if writer else "(live on entry)"
        if every or not _MATH.match(text):
            rows.append(f"  R{register:<4} /*{writer.address if writer else 0:04x}*/ {text}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=pathlib.Path, help="an object file (.o) or a cubin")
    parser.add_argument("--kernel", default="", help="a substring of the mangled kernel names to report")
    parser.add_argument("--context", type=int, default=6, help="instructions shown before each peak")
    parser.add_argument("--live", action="store_true", help="the registers live at the first peak")
    parser.add_argument("--all", action="store_true", help="with --live: the math's registers too")
    args = parser.parse_args(argv)
    nvdisasm = find_tool("nvdisasm")
    if nvdisasm is None:
        raise SystemExit(
            "nvdisasm not found: pip install nvidia-cuda-nvdisasm (or put the CUDA toolkit on PATH)"
        )
    reported = 0
    with tempfile.TemporaryDirectory() as tmp:
        for cubin in cubins(args.path, pathlib.Path(tmp)):
            for name, instructions in listing(nvdisasm, cubin).items():
                if args.kernel not in name or not instructions:
                    continue
                reported += 1
                top, starts = peaks(instructions)
                print(f"{name}: peak {top} live registers, reached at {len(starts)} place(s)")
                for start in starts:
                    print("  ----")
                    for i in instructions[max(0, start - args.context) : start + 2]:
                        print(f"  /*{i.address:04x}*/ {i.live:4d}  {i.text}")
                if args.live:
                    print(f"  live at /*{instructions[starts[0]].address:04x}*/:")
                    print("\n".join(live_values(instructions, instructions[starts[0]].address, args.all)))
    if reported == 0:
        raise SystemExit(f"no kernel named like {args.kernel!r} in {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
