"""Running a built kernel that the plan does not list yet: its GPU tests (and the CPU tests of its
lowering) come before its rows enter `jzyfa.plan.KERNELS`, so they add the rows for one test."""

import jax

from jzyfa import plan


def add_rows(monkeypatch, family: str, head_dims: tuple[int, int], layouts=plan.LAYOUTS) -> None:
    """`plan.KERNELS` with (family, head_dims) at every mask and the given layouts for this test (a no-op
    once the plan has them); traces cached without the rows are dropped."""
    rows = {plan.Config(family, head_dims, mask, layout) for mask in plan.MASKS for layout in layouts}
    if rows <= plan.KERNELS:
        return
    monkeypatch.setattr(plan, "KERNELS", plan.KERNELS | rows)
    jax.clear_caches()
