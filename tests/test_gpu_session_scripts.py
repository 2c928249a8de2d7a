"""The shell tools of a GPU session (tools/gpu_session.sh, tools/where_hung.sh) parse, and where_hung.sh
leaves a command that finishes alone. The GPU parts (ncu, cuda-gdb) run only on the H200 machines."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"


@pytest.mark.parametrize("script", ["gpu_session.sh", "where_hung.sh", "real_model_session.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(TOOLS / script)], check=True)


def test_where_hung_reports_a_command_that_finished():
    done = subprocess.run(
        ["bash", str(TOOLS / "where_hung.sh"), "1", "bash", "-c", "exit 3"], capture_output=True, text=True
    )
    assert "finished within 1 s (exit 3): nothing hung" in done.stdout


def test_profile_call_parses_its_flags():
    done = subprocess.run(
        [sys.executable, str(TOOLS / "profile_call.py"), "--help"], capture_output=True, text=True, check=True
    )
    assert "--dtype" in done.stdout and "--seq" in done.stdout
