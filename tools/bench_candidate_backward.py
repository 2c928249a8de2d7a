"""`python -m jzyfa.bench` with the built backward kernels in the plan: times a candidate backward
before its GPU tests have promoted its rows into jzyfa/plan.py.

The built extension lists its backward instantiations apart (`bwd_kernels()`); this adds them to
`jzyfa.plan.KERNELS` for this process only and runs the benchmark with the flags given, e.g.

    python tools/bench_candidate_backward.py --direction fwd,bwd,fwd+bwd --impls jzyfa,cudnn

The rows still pass the benchmark's float64 check of the gradients, so a wrong kernel shows as "bad"
in its table. Without the extension (a CPU machine) nothing is added and the benchmark runs as usual.
"""

from __future__ import annotations

import sys

from jzyfa import _extension, plan


def candidate_rows() -> set[plan.Config]:
    """The built extension's backward rows, as plan rows (empty without the extension)."""
    if not _extension.extension_loaded():
        return set()
    from jzyfa import _jzyfa_ffi  # only where the extension loaded

    listed = getattr(_jzyfa_ffi, "bwd_kernels", list)()
    return {
        plan.Config(family, (qk, v), mask, layout, direction)
        for family, qk, v, mask, layout, direction in listed
    }


def main(argv: list[str]) -> None:
    rows = candidate_rows()
    print(f"[bench_candidate_backward] {len(rows)} backward rows added to the plan", file=sys.stderr)
    plan.KERNELS = plan.KERNELS | rows
    from jzyfa.bench.speed import run_main  # after the plan has its rows

    sys.argv = ["jzyfa.bench", *argv]
    run_main()


if __name__ == "__main__":
    main(sys.argv[1:])
