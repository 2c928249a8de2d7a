"""Writes README.md's support matrix from the plan (jzyfa.plan.support_matrix_markdown).

    python tools/support_matrix.py           # rewrite the section between the markers
    python tools/support_matrix.py --check   # exit 1 if README.md is out of date
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN = "<!-- support-matrix:begin -->"
END = "<!-- support-matrix:end -->"


def generated() -> str:
    sys.path.insert(0, str(ROOT))
    from jzyfa import plan  # noqa: PLC0415

    return plan.support_matrix_markdown().strip()


def current_section(text: str) -> str:
    """The text between the markers, stripped."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def replace_section(text: str, body: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + body + "\n" + text[end:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    parser.add_argument("--readme", type=pathlib.Path, default=README)
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"{args.readme}: markers {BEGIN} / {END} not found", file=sys.stderr)
        return 2
    body = generated()
    if current_section(text) == body:
        return 0
    if args.check:
        print(f"{args.readme}: the support matrix is out of date; run python tools/support_matrix.py", file=sys.stderr)
        return 1
    args.readme.write_text(replace_section(text, body))
    print(f"{args.readme}: support matrix updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
