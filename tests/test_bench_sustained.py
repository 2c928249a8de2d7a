"""`python -m jzyfa.bench --sustained SECONDS`: back-to-back bursts, two interleaved passes, rows
labelled "<impl> sustained" in the same report (CPU, a tiny SECONDS)."""

from bench_helpers import resolve_config

from jzyfa.bench import speed, sustained
from jzyfa.bench import timing as _timing


def test_sustained_rows_follow_the_normal_ones():
    config = resolve_config(["--smoke", "--shapes", "1x64", "--inputs", "gaussian", "--impls", "jzyfa,jzyfa_xla",
                             "--sustained", "0.05"])  # fmt: skip
    assert config["sustained"] == 0.05
    report = speed.run(config)
    impls = [r["impl"] for r in report["results"]]
    assert impls == ["jzyfa", "jzyfa_xla", "jzyfa sustained", "jzyfa_xla sustained"]
    for r in report["results"][2:]:
        assert r["status"] == "ok" and r["timing_source"] == "sustained"
        runs = r["sustained"]["passes"]
        assert len(runs) == sustained.PASSES and r["sustained"]["seconds"] == 0.05
        best = max(runs, key=lambda p: p["calls_per_s"])
        assert r["tflops"] == best["tflops"] > 0
        assert abs(r["median_ms"] - 1e3 * best["seconds"] / best["calls"]) < 1e-9
        assert r["sm_clock_mhz"] is None and r["board_power_w"] is None  # no clock on a CPU: n/a
    table = speed.format_markdown(report["results"], report["env"], report["config"])
    assert "jzyfa_xla sustained" in table


def test_passes_interleave():
    order = []

    def entry(name):
        def fn(x):
            order.append(name)
            return x

        row = {"impl": name, "flops": 1e12, "status": "ok"}
        return sustained.Entry(row, fn, [(0,)], lambda out: out, per_call_s=1.0)

    monitor = _timing.ClockMonitor(None)
    rows = sustained.sustained_rows([entry("a"), entry("b")], seconds=1.0, monitor=monitor)
    assert order == ["a", "b", "a", "b"]  # one call per burst at 1 s per call
    assert [r["impl"] for r in rows] == ["a sustained", "b sustained"]
    assert all(r["sm_clock_mhz"] is None for r in rows)


def test_sustained_off_by_default():
    config = resolve_config(["--smoke", "--shapes", "1x64", "--inputs", "gaussian", "--impls", "jzyfa_xla"])
    assert config["sustained"] == 0
    assert [r["impl"] for r in speed.run(config)["results"]] == ["jzyfa_xla"]
