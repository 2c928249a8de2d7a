"""`python -m jzyfa.bench`'s flags parsed as the command parses them, for the bench tests."""

from __future__ import annotations

from absl import flags

from jzyfa import bench


def resolve_config(argv: list[str]) -> dict:
    """bench.resolve_config() after parsing argv (without the program name); flags reset afterwards."""
    try:
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["bench", *argv])
        return bench.resolve_config()
    finally:
        flags.FLAGS.unparse_flags()
