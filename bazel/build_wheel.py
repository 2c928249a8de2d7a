"""Writes the jzyfa wheel for the Bazel build (target //:wheel).

A wheel is a zip file with the package's files and a `<name>-<version>.dist-info/`
directory holding METADATA, WHEEL and RECORD (PEP 427, core metadata 2.1). The
metadata comes from pyproject.toml's [project] table, as scikit-build-core
writes it for the CMake build. Entries are stored in sorted order with a fixed
timestamp, so the same inputs give the same bytes.

Usage:
  build_wheel.py --pyproject pyproject.toml --out DIST-VER-PY-ABI-PLAT.whl \
      [--readme README.md] --file ARCNAME=PATH [--file ARCNAME=PATH ...]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import sys
import zipfile

try:
    import tomllib  # Python >= 3.11
except ImportError:  # pragma: no cover - older interpreters
    tomllib = None

_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
_GENERATOR = "jzyfa-bazel (bazel/build_wheel.py)"


def _fail(message: str) -> None:
    print(f"build_wheel.py: {message}", file=sys.stderr)
    sys.exit(1)


def _read_project(pyproject: str) -> dict:
    with open(pyproject, "rb") as f:
        data = f.read()
    if tomllib is None:
        _fail("needs Python >= 3.11 (tomllib) to read pyproject.toml")
    return tomllib.loads(data.decode("utf-8"))["project"]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name)


def _metadata(project: dict, readme: str | None) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
    ]
    if project.get("description"):
        lines.append(f"Summary: {project['description']}")
    license_ = project.get("license")
    if isinstance(license_, dict) and license_.get("text"):
        lines.append(f"License: {license_['text']}")
    elif isinstance(license_, str):
        lines.append(f"License: {license_}")
    if project.get("requires-python"):
        lines.append(f"Requires-Python: {project['requires-python']}")
    for requirement in project.get("dependencies", []):
        lines.append(f"Requires-Dist: {requirement}")
    for extra, requirements in sorted(project.get("optional-dependencies", {}).items()):
        lines.append(f"Provides-Extra: {extra}")
        for requirement in requirements:
            marker = f'extra == "{extra}"'
            if ";" in requirement:
                spec, existing = requirement.split(";", 1)
                lines.append(f"Requires-Dist: {spec.strip()} ; ({existing.strip()}) and {marker}")
            else:
                lines.append(f"Requires-Dist: {requirement} ; {marker}")
    body = ""
    if readme:
        lines.append("Description-Content-Type: text/markdown")
        with open(readme, encoding="utf-8") as f:
            body = f.read()
    return "\n".join(lines) + "\n\n" + body


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode("ascii")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", required=True)
    parser.add_argument("--out", required=True, help="the wheel to write")
    parser.add_argument("--readme", help="long description (markdown)")
    parser.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="ARCNAME=PATH",
        help="a file to put in the wheel at ARCNAME",
    )
    args = parser.parse_args()

    project = _read_project(args.pyproject)
    dist = _normalize(project["name"])
    version = project["version"]
    wheel_name = os.path.basename(args.out)
    match = re.fullmatch(r"([^-]+)-([^-]+)-([^-]+)-([^-]+)-([^-]+)\.whl", wheel_name)
    if not match:
        _fail(f"{wheel_name} is not a wheel file name")
    if match.group(1) != dist or match.group(2) != version:
        _fail(
            f"pyproject.toml says {dist} {version} but the output is {wheel_name}: the "
            "@jzyfa_python repository is stale; run `bazel sync --configure` (or restart "
            "the Bazel server) and build again"
        )
    tag = "-".join(match.group(3, 4, 5))

    files: dict[str, str] = {}
    for item in args.file:
        arcname, sep, path = item.partition("=")
        if not sep or not arcname or not path:
            _fail(f"--file takes ARCNAME=PATH, not {item!r}")
        if arcname in files:
            _fail(f"{arcname} given twice")
        files[arcname] = path

    dist_info = f"{dist}-{version}.dist-info"
    contents: list[tuple[str, bytes, bool]] = []
    for arcname in sorted(files):
        path = files[arcname]
        with open(path, "rb") as f:
            data = f.read()
        executable = os.access(path, os.X_OK) and arcname.endswith(".so")
        contents.append((arcname, data, executable))
    contents.append((f"{dist_info}/METADATA", _metadata(project, args.readme).encode(), False))
    wheel_text = f"Wheel-Version: 1.0\nGenerator: {_GENERATOR}\nRoot-Is-Purelib: false\nTag: {tag}\n"
    contents.append((f"{dist_info}/WHEEL", wheel_text.encode(), False))
    top_level = sorted({name.split("/", 1)[0] for name in files if "/" in name})
    contents.append((f"{dist_info}/top_level.txt", ("\n".join(top_level) + "\n").encode(), False))

    record_name = f"{dist_info}/RECORD"
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data, _ in contents)
    record += f"{record_name},,\n"
    contents.append((record_name, record.encode(), False))

    tmp = args.out + ".tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        for name, data, executable in contents:
            info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = ((0o755 if executable else 0o644) | 0o100000) << 16
            wheel.writestr(info, data)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
