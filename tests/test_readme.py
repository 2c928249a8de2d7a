"""README.md and docs/ serve users and describe the design: the support matrix comes from the plan,
the README stays short, and no history (dates, verification flags, patches) lives outside the one
dated log, docs/benchmarks.md. CPU only."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from jzyfa import plan

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT / "tools"))
import support_matrix  # noqa: E402

MAX_README_LINES = 200
MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*"
DATE = re.compile(rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b\d{{1,2}} {MONTH} \d{{4}}\b|\b{MONTH} \d{{1,2}},? \d{{4}}\b")
FORBIDDEN = ("_VERIFIED", "JZYFA_UNVERIFIED", "docs/patches")


def _checked_files():
    """README, docs/ (but the dated log) and the package's text files."""
    files = [README]
    files += [p for p in sorted((ROOT / "docs").rglob("*")) if p.is_file() and p.suffix in (".md", ".txt")]
    files = [p for p in files if p != ROOT / "docs" / "benchmarks.md"]
    files += sorted((ROOT / "jzyfa").rglob("*.py"))
    return files


def test_support_matrix_matches_the_plan():
    assert support_matrix.current_section(README.read_text()) == plan.support_matrix_markdown().strip(), (
        "README's support matrix differs from jzyfa.plan: run python tools/support_matrix.py"
    )


def test_support_matrix_check_command():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "support_matrix.py"), "--check"], cwd=ROOT)
    assert result.returncode == 0


def test_support_matrix_check_fails_when_out_of_date(tmp_path):
    stale = tmp_path / "README.md"
    text = README.read_text()
    stale.write_text(support_matrix.replace_section(text, "| stale |"))
    assert support_matrix.main(["--check", "--readme", str(stale)]) == 1
    assert support_matrix.main(["--readme", str(stale)]) == 0
    assert stale.read_text() == text


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines, at most {MAX_README_LINES}"


def test_readme_keeps_the_ci_test_command():
    assert "bash tools/bootstrap.sh test" in README.read_text()
    assert "bash tools/bootstrap.sh example" in README.read_text()


@pytest.mark.parametrize("path", _checked_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_history_outside_the_log(path):
    problems = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if match := DATE.search(line):
            problems.append(f"{number}: date {match.group()}")
        problems += [f"{number}: {word}" for word in FORBIDDEN if word in line]
    assert not problems, f"{path.relative_to(ROOT)}: " + "; ".join(problems[:10])


def test_no_patches_folder():
    assert not (ROOT / "docs" / "patches").exists()
