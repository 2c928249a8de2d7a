"""jzyfa's version: pyproject.toml's `version`, the one source.

Installed, it comes from the package metadata; in a source checkout that is not installed (PYTHONPATH
or Bazel's py_library), from the pyproject.toml next to the package.
"""

from __future__ import annotations

import importlib.metadata
import pathlib

import tomllib

UNKNOWN = "0+unknown"


def _from_pyproject() -> str | None:
    path = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        with path.open("rb") as f:
            project = tomllib.load(f).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return project.get("version") if project.get("name") == "jzyfa" else None


def package_version() -> str:
    """pyproject's version for a source checkout, else the installed metadata's, else UNKNOWN."""
    checkout = _from_pyproject()
    if checkout is not None:
        return checkout
    try:
        return importlib.metadata.version("jzyfa")
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN
