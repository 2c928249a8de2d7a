"""tools/source_stamp.sh: the line that names what a jzyfa build is made from, by which
tools/real_model_session.sh decides whether an installed extension may be reused. CPU only."""

import os
import pathlib
import shutil
import subprocess

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tools" / "source_stamp.sh"


def _stamp(tree, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("CUDAFLAGS", "JZYFA_MEASURE")}
    full.update(env)
    return subprocess.run(
        ["bash", str(SCRIPT), str(tree)], env=full, check=True, capture_output=True, text=True
    ).stdout.strip()


def _tree(tmp_path):
    tree = tmp_path / "tree"
    for name in ("ffi", "jzyfa", "asm"):
        (tree / name).mkdir(parents=True)
    (tree / "ffi" / "kernel.cuh").write_text("// kernel\n")
    (tree / "asm" / "gen_ptx.py").write_text("# the PTX wrappers the kernels include\n")
    (tree / "jzyfa" / "plan.py").write_text("X = 1\n")
    (tree / "CMakeLists.txt").write_text("project(x)\n")
    (tree / "pyproject.toml").write_text("[project]\n")
    return tree


def test_stamp_follows_the_sources_and_build_variables(tmp_path):
    tree = _tree(tmp_path)
    first = _stamp(tree)
    assert first.startswith("sources ") and first == _stamp(tree)
    copy = tmp_path / "copy"
    shutil.copytree(tree, copy)
    assert _stamp(copy) == first  # the content names the build, not the path
    (tree / "jzyfa" / "__pycache__").mkdir()
    (tree / "jzyfa" / "__pycache__" / "plan.cpython-312.pyc").write_bytes(b"\0")
    (tree / "jzyfa" / "_jzyfa_ffi.so").write_bytes(b"\0")
    assert _stamp(tree) == first  # caches and built libraries are no source
    assert _stamp(tree, CUDAFLAGS="-lineinfo") != first
    assert _stamp(tree, JZYFA_MEASURE="timeline") != first
    (tree / "asm" / "gen_ptx.py").write_text("# changed\n")
    second = _stamp(tree)
    assert second != first  # the generated PTX header is a build input
    (tree / "ffi" / "kernel.cuh").write_text("// kernel, changed\n")
    assert _stamp(tree) != second


def test_stamp_of_this_checkout():
    assert _stamp(REPO).startswith("sources ")


def _session(tmp_path, site):
    """tools/real_model_session.sh's GPU path up to its first step, with stand-ins: nvidia-smi prints
    nothing and PYTHON is `false`, so the build (if it runs) and training fail at once."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDAFLAGS", "JZYFA_MEASURE")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}", PYTHON="false", JZYFA_SITE=str(site), WORK_DIR=str(tmp_path / "work")
    )
    proc = subprocess.run(
        ["bash", str(REPO / "tools" / "real_model_session.sh"), str(tmp_path / "out")],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.stdout


def _installed_site(tmp_path, stamp):
    site = tmp_path / "site"
    (site / "jzyfa").mkdir(parents=True)
    (site / "jzyfa" / "_jzyfa_ffi.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\0")
    (site / "jzyfa-source.txt").write_text(stamp + "\n")
    return site


def test_real_model_session_reuses_a_build_of_its_own_tree(tmp_path):
    site = _installed_site(tmp_path, _stamp(REPO))
    out = _session(tmp_path, site)
    assert "jzyfa: reusing the build" in out and "=== build" not in out and "=== train" in out
    assert (site / "jzyfa").is_dir()


def test_real_model_session_rebuilds_over_another_trees_build(tmp_path):
    site = _installed_site(tmp_path, "sources 0123456789abcdef CUDAFLAGS= JZYFA_MEASURE=")
    out = _session(tmp_path, site)
    assert "holds another build (sources 0123456789abcdef" in out
    assert "BUILD FAILED" in out and not (site / "jzyfa").exists()
