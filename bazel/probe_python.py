"""Run by the @jzyfa_python repository rule with the configured interpreter.

Prints, as one JSON object, what the Bazel build needs to know about that
interpreter: its headers and extension suffix, where its pip-installed
nanobind sources and jax's XLA FFI headers are, the wheel tags, and the
project's name and version from pyproject.toml (argv[1]).
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig


def fail(message: str) -> None:
    print(f"jzyfa: {message} (interpreter: {sys.executable})", file=sys.stderr)
    sys.exit(1)


def project_name_and_version(pyproject: str) -> tuple[str, str]:
    with open(pyproject, "rb") as f:
        data = f.read()
    try:
        import tomllib  # Python >= 3.11
    except ImportError:
        tomllib = None
    if tomllib is not None:
        project = tomllib.loads(data.decode("utf-8"))["project"]
        return project["name"], project["version"]
    # Older Pythons: the two keys of the [project] table, read plainly.
    text = data.decode("utf-8")
    section = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if not section:
        fail(f"no [project] table in {pyproject}")
    fields = dict(re.findall(r'^(name|version)\s*=\s*"([^"]*)"', section.group(1), re.M))
    return fields["name"], fields["version"]


def wheel_tags() -> tuple[str, str, str]:
    impl = sys.implementation.name
    if impl != "cpython":
        fail(f"only CPython is supported, not {impl}")
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    abi = f"cp{version}" + ("t" if sysconfig.get_config_var("Py_GIL_DISABLED") else "")
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"cp{version}", abi, platform


def main() -> None:
    if len(sys.argv) != 2:
        fail("usage: probe_python.py PYPROJECT")
    include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        fail(f"Python.h not found in {include}: install the Python development headers")
    ext_suffix = sysconfig.get_config_var("EXT_SUFFIX")

    try:
        import nanobind
    except ImportError as e:
        fail(f"nanobind is not importable ({e}); pip install nanobind, or set PYTHON_BIN_PATH")
    nb_include = nanobind.include_dir()
    nb_src = nanobind.source_dir()
    nb_root = os.path.dirname(nb_include)
    robin_map = os.path.join(nb_root, "ext", "robin_map", "include")
    for path in (nb_include, nb_src, robin_map):
        if not os.path.isdir(path):
            fail(f"nanobind's pip package lacks {path}")

    try:
        import jax.ffi
    except ImportError as e:
        fail(f"jax is not importable ({e}); pip install jax, or set PYTHON_BIN_PATH")
    ffi_include = jax.ffi.include_dir()
    if not os.path.isfile(os.path.join(ffi_include, "xla", "ffi", "api", "ffi.h")):
        fail(f"xla/ffi/api/ffi.h not found in jax.ffi.include_dir() = {ffi_include}")

    name, version = project_name_and_version(sys.argv[1])
    python_tag, abi_tag, platform_tag = wheel_tags()
    # Wheel file names escape runs of '-', '_' and '.' in the distribution name as '_'.
    dist = re.sub(r"[-_.]+", "_", name)
    json.dump(
        {
            "executable": sys.executable,
            "version": f"{sys.version_info.major}.{sys.version_info.minor}",
            "python_include": include,
            "ext_suffix": ext_suffix,
            "free_threaded": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
            "nanobind_root": nb_root,
            "nanobind_version": getattr(nanobind, "__version__", "unknown"),
            "xla_ffi_include": ffi_include,
            "project_name": name,
            "project_version": version,
            "wheel_name": f"{dist}-{version}-{python_tag}-{abi_tag}-{platform_tag}.whl",
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
