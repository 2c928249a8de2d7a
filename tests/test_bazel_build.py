"""The Bazel build (WORKSPACE, BUILD.bazel, bazel/) makes the extension and a working wheel, offline.

Runs `bazel build //:wheel` from scratch in a temporary output root (a new Bazel server, every local
repository configured anew, every action run), with the interpreter running these tests as the
build's Python (PYTHON_BIN_PATH). The workspace's .bazelrc forbids downloads, so a build that
needed the network fails here. Then installs the wheel into a temporary directory and imports
`jzyfa._jzyfa_ffi` from it in a fresh interpreter.

Needs `bazel` (Debian's bazel-bootstrap, Bazel 4.2.3), the CUDA toolkit (nvcc) and nanobind + jax
importable by this interpreter. Without bazel the test fails, saying so, unless JZYFA_SKIP_BAZEL=1.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 1800
TARGET = "jzyfa_attention_fwd"


def _bazel() -> str:
    if os.environ.get("JZYFA_SKIP_BAZEL") == "1":
        pytest.skip("JZYFA_SKIP_BAZEL=1: the Bazel build is not tested")
    exe = shutil.which("bazel")
    if exe is None:
        pytest.fail(
            "bazel is not installed, so the Bazel build cannot be tested. Install it with "
            "`apt-get install -y bazel-bootstrap` (Bazel 4.2.3), or set JZYFA_SKIP_BAZEL=1 to skip "
            "this test deliberately.",
            pytrace=False,
        )
    return exe


def _project() -> dict:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    if tomllib is not None:
        return tomllib.loads(text)["project"]
    section = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S).group(1)
    return dict(re.findall(r'^(name|version)\s*=\s*"([^"]*)"', section, re.M))


def _remove_tree(path: Path) -> None:
    # Bazel leaves read-only directories in its output base.
    def make_writable_and_retry(func, p, _):
        os.chmod(p, stat.S_IRWXU)
        parent = os.path.dirname(p)
        os.chmod(parent, stat.S_IRWXU)
        func(p)

    shutil.rmtree(path, onerror=make_writable_and_retry)


@pytest.fixture(scope="module")
def bazel_wheel(tmp_path_factory) -> Path:
    """Builds //:wheel from scratch; returns a copy of the wheel."""
    bazel = _bazel()
    root = tmp_path_factory.mktemp("bazel_root")
    startup = [bazel, f"--output_user_root={root}", "--max_idle_secs=60"]
    env = dict(os.environ, PYTHON_BIN_PATH=sys.executable)
    build = startup + [
        "build",
        "--symlink_prefix=/",  # leave no bazel-* links in the source tree
        "--experimental_repository_disable_download",  # offline (.bazelrc says so too)
        f"--repo_env=PYTHON_BIN_PATH={sys.executable}",
        "//:wheel",
    ]
    try:
        start = time.monotonic()
        result = subprocess.run(
            build,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        elapsed = time.monotonic() - start
        if result.returncode != 0:
            pytest.fail(
                f"`{' '.join(build)}` failed (exit {result.returncode}) after {elapsed:.0f} s:\n"
                + result.stdout[-20000:],
                pytrace=False,
            )
        print(f"clean Bazel build of //:wheel: {elapsed:.1f} s")
        bin_dir = subprocess.run(
            startup + ["info", f"--repo_env=PYTHON_BIN_PATH={sys.executable}", "bazel-bin"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            check=True,
        ).stdout.strip()
        wheels = sorted(Path(bin_dir).glob("*.whl"))
        assert len(wheels) == 1, f"expected one wheel in {bin_dir}, found {wheels}"
        out = tmp_path_factory.mktemp("wheel") / wheels[0].name
        shutil.copyfile(wheels[0], out)
        return out
    finally:
        subprocess.run(
            startup + ["shutdown"], cwd=REPO, env=env, capture_output=True, timeout=300, check=False
        )
        _remove_tree(root)


def test_wheel_name_and_metadata(bazel_wheel: Path):
    project = _project()
    dist = re.sub(r"[-_.]+", "_", project["name"])
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert re.fullmatch(
        rf"{dist}-{re.escape(project['version'])}-{py}-{py}t?-linux_\w+\.whl", bazel_wheel.name
    ), bazel_wheel.name

    with zipfile.ZipFile(bazel_wheel) as wheel:
        names = wheel.namelist()
        dist_info = f"{dist}-{project['version']}.dist-info"
        metadata = wheel.read(f"{dist_info}/METADATA").decode()
        assert f"Name: {project['name']}\n" in metadata
        assert f"Version: {project['version']}\n" in metadata
        assert "Root-Is-Purelib: false" in wheel.read(f"{dist_info}/WHEEL").decode()

        # Every Python file of the package, and the extension next to them.
        expected = {f"jzyfa/{p.name}" for p in (REPO / "jzyfa").glob("*.py")}
        assert expected <= set(names), expected - set(names)
        extensions = [n for n in names if re.fullmatch(r"jzyfa/_jzyfa_ffi\..*so", n)]
        assert len(extensions) == 1, names

        # RECORD lists every other file with its right hash and size.
        record = list(csv.reader(io.StringIO(wheel.read(f"{dist_info}/RECORD").decode())))
        recorded = {row[0]: row[1:] for row in record}
        assert set(recorded) == set(names)
        for name, (digest, size) in recorded.items():
            if name.endswith("/RECORD"):
                continue
            data = wheel.read(name)
            expected_digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert digest == "sha256=" + expected_digest.decode(), name
            assert int(size) == len(data), name


def test_wheel_installs_and_extension_imports(bazel_wheel: Path, tmp_path: Path):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--quiet",
            "--target",
            str(target),
            str(bazel_wheel),
        ],
        check=True,
        timeout=300,
    )
    program = textwrap.dedent(f"""
      import json, sys
      sys.path.insert(0, {str(target)!r})
      # An editable install of jzyfa in this environment would redirect the import to the
      # source tree; take its finders out so the installed wheel is what gets imported.
      sys.meta_path = [f for f in sys.meta_path
                       if "editable" not in (getattr(f, "__module__", "") or "").lower()]
      import jzyfa._jzyfa_ffi as ext
      targets = ext.registrations()
      print(json.dumps({{
          "file": ext.__file__,
          "package": __import__("jzyfa").__file__,
          "targets": {{name: type(value).__name__ for name, value in targets.items()}},
      }}))
      """)
    result = subprocess.run(
        [sys.executable, "-c", program],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["file"].startswith(str(target)), info
    assert info["package"].startswith(str(target)), info
    for target_name in (TARGET, "jzyfa_fp8_value_operand"):
        assert info["targets"].get(target_name) == "PyCapsule", info


def _cmake_cuda_flags() -> list[str]:
    text = (REPO / "CMakeLists.txt").read_text(encoding="utf-8")
    match = re.search(r"\$<\$<COMPILE_LANGUAGE:CUDA>:(.*?)>\)", text, re.S)
    assert match, "CMakeLists.txt: no $<$<COMPILE_LANGUAGE:CUDA>:...> compile options found"
    return match.group(1).split()


def test_nvcc_flags_match_cmake():
    """BUILD.bazel compiles the kernels with the nvcc flags CMakeLists.txt gives them."""
    build = (REPO / "BUILD.bazel").read_text(encoding="utf-8")
    missing = [f for f in _cmake_cuda_flags() if f'"{f}"' not in build]
    assert not missing, f"BUILD.bazel's NVCC_FLAGS lack CMakeLists.txt's {missing}"
