"""tools/bench_candidate_backward.py: the built extension's backward rows join the plan for the benchmark's
process only, and the benchmark runs with the flags given (smoke mode on a CPU)."""

import sys

from repo_tools import load_tool

from jzyfa import _extension, plan


def test_rows_are_the_extensions_backward_instantiations(monkeypatch):
    tool = load_tool("bench_candidate_backward")
    monkeypatch.setattr(_extension, "extension_loaded", lambda: True)
    fake = type(sys)("jzyfa._jzyfa_ffi")
    fake.bwd_kernels = lambda: [("16bit", 128, 128, "causal", "varlen", "bwd")]
    monkeypatch.setitem(sys.modules, "jzyfa._jzyfa_ffi", fake)
    import jzyfa

    monkeypatch.setattr(jzyfa, "_jzyfa_ffi", fake, raising=False)
    assert tool.candidate_rows() == {plan.Config("16bit", (128, 128), "causal", "varlen", "bwd")}


def test_runs_the_benchmark_with_the_rows(monkeypatch, capsys):
    tool = load_tool("bench_candidate_backward")
    rows = {plan.Config("16bit", (64, 64), "none", "dense", "bwd")}
    monkeypatch.setattr(tool, "candidate_rows", lambda: rows)
    monkeypatch.setattr(plan, "KERNELS", plan.KERNELS)  # restored after the test
    seen = {}

    def fake_run_main():
        seen["argv"] = list(sys.argv)
        seen["rows"] = rows <= plan.KERNELS

    import jzyfa.bench.speed

    monkeypatch.setattr(jzyfa.bench.speed, "run_main", fake_run_main)
    monkeypatch.setattr(sys, "argv", ["x"])
    tool.main(["--direction", "bwd", "--smoke"])
    assert seen == {"argv": ["jzyfa.bench", "--direction", "bwd", "--smoke"], "rows": True}
    assert "1 backward rows added" in capsys.readouterr().err
