"""Packaging (issue 31 item 8): one version source, py.typed in the wheel, floors that CI tests, extras."""

import importlib.metadata
import pathlib
import re

import pytest
import tomllib

import jzyfa
from jzyfa import _version

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _floor(requirements, name):
    for req in requirements:
        if m := re.fullmatch(rf"{name}\s*>=\s*([\d.]+)", req.strip()):
            return m.group(1)
    raise AssertionError(f"no {name}>= floor in {requirements}")


def test_version_is_pyprojects():
    assert jzyfa.__version__ == PROJECT["version"]
    assert "__version__" in jzyfa.__all__


def test_version_falls_back_to_metadata_then_unknown(monkeypatch):
    monkeypatch.setattr(_version, "_from_pyproject", lambda: None)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    assert _version.package_version() == "9.9.9"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert _version.package_version() == _version.UNKNOWN


def test_py_typed_ships_in_the_wheel():
    assert (ROOT / "jzyfa" / "py.typed").is_file()
    # scikit-build-core copies every file of the listed packages; Bazel globs jzyfa/** minus caches.
    assert PYPROJECT["tool"]["scikit-build"]["wheel"]["packages"] == ["jzyfa"]
    build = (ROOT / "BUILD.bazel").read_text()
    glob = re.search(r"PACKAGE_FILES = glob\((.*?)\n\)", build, re.DOTALL).group(1)
    assert '"jzyfa/**"' in glob and "typed" not in glob


def test_floors_match_ci_and_readme():
    dev = (ROOT / "requirements-dev.txt").read_text().splitlines()
    for name in ("jax", "jaxlib"):
        assert _floor(PROJECT["dependencies"], name) == _floor(dev, name)
    assert _floor(PYPROJECT["build-system"]["requires"], "jax") == _floor(dev, "jax")
    python = re.search(r"Python (\d+\.\d+)\+", (ROOT / "README.md").read_text()).group(1)
    assert PROJECT["requires-python"] == f">={python}"


@pytest.mark.parametrize(
    ("extra", "package"), [("test", "pytest"), ("export", "flatbuffers"), ("bench", "matplotlib")]
)
def test_extras(extra, package):
    assert package in PROJECT["optional-dependencies"][extra]
