"""What the bench's three reports (speed, accuracy, overhead) share: one-line errors, tables, strict JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np


def short_error(e: BaseException, limit: int = 300) -> str:
    """'Type: first line of the message', cut to `limit` characters (ending in '...' when cut)."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fmt(value, spec: str, missing: str = "n/a") -> str:
    """`value` formatted by `spec`, or `missing` for None."""
    return missing if value is None else format(value, spec)


def split_list(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']: a comma-separated flag's items."""
    return [s.strip() for s in text.split(",") if s.strip()]


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str] | None = None
) -> list[str]:
    """A markdown table's lines; `|` inside a cell is escaped. align: one '---' or '---:' per column."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    rule = "|" + "|".join(align) + "|" if align else "|" + "---|" * len(header)
    return [line(header), rule] + [line(row) for row in rows]


def plain_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """Columns padded to their widest cell (those in `right` right-aligned), the last one unpadded."""
    table = [list(header)] + [list(row) for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    lines = []
    for row in table:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    return lines


def json_safe(value):
    """A report as strict JSON values: dataclasses as dicts, NumPy values unwrapped, non-finite floats
    as strings ("nan", "inf")."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json_safe(dataclasses.asdict(value))
    if isinstance(value, (np.generic, np.ndarray)):
        return json_safe(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(json_safe(report), f, indent=1, allow_nan=False)
        f.write("\n")


def logger(program: str):
    """log(text): '[program] text' on stderr, flushed (the progress lines)."""

    def log(text: str) -> None:
        print(f"[{program}] {text}", file=sys.stderr, flush=True)

    return log


HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def run_absl(main, doc: str | None, argv: Sequence[str] | None = None) -> None:
    """absl's app.run(main), except that --help (and its forms) prints `doc` and the program's own
    flags (not absl's) to stdout and exits 0, where absl's help exits 1."""
    from absl import app, flags

    argv = list(sys.argv if argv is None else argv)
    if any(arg in HELP_FLAGS for arg in argv[1:]):
        print((doc or "").strip() + "\n")
        for module in flags.FLAGS.flags_by_module_dict():
            if not module.startswith("absl"):
                print(flags.FLAGS.module_help(module))
        sys.exit(0)
    app.run(main, argv)
