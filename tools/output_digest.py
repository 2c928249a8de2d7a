"""A digest of the kernels' outputs on fixed inputs, one line per configuration: run it on two builds
that should compute bitwise the same thing (a scheduling experiment behind a build flag, a refactor)
and compare the lines.

    python tools/output_digest.py                 # on a Hopper GPU with the extension built
    python tools/output_digest.py --implementation xla   # the pure-JAX path (the tool's own test)

Each line names the call and gives the SHA-256 of O's and the LSE's bytes (first 16 hex digits) and
O's sum of squares, so a difference that is only a digest change can be told from a broken output.
tools/gpu_session.sh runs it on A and B with JZYFA_AB_TOOLS="tools/output_digest.py"; the lines then
come back prefixed "A " and "B ", and `--compare FILE` prints the configurations whose digests differ.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np

# (name, dtype, batch, seq_q, seq_k, heads_q, heads_kv, head_dim, head_dim_v, options)
DENSE_CASES = (
    ("bf16 causal hd128", "bf16", 2, 1536, 1536, 4, 4, 128, 128, {"causal": True}),
    ("bf16 nocausal hd128", "bf16", 1, 1000, 1300, 4, 2, 128, 128, {}),
    ("f16 causal hd64", "f16", 2, 1100, 1100, 4, 4, 64, 64, {"causal": True}),
    ("bf16 window hd128", "bf16", 1, 2048, 2048, 4, 4, 128, 128, {"window": (300, 0)}),
    ("bf16 mla 192/128", "bf16", 1, 1024, 1024, 4, 4, 192, 128, {"causal": True}),
    ("fp8 lean causal", "fp8", 2, 1536, 1536, 4, 4, 128, 128, {"causal": True}),
    ("fp8 exact causal", "fp8", 2, 1536, 1536, 4, 4, 128, 128, {"causal": True, "lean_p": False}),
    ("fp8 lean nocausal gqa", "fp8", 1, 1000, 4100, 8, 2, 128, 128, {}),
    ("fp8 lean window", "fp8", 1, 2048, 2048, 4, 4, 128, 128, {"window": (300, 0)}),
    ("fp8 lean mla 192/128", "fp8", 1, 1024, 1024, 4, 4, 192, 128, {"causal": True}),
    ("bf16 causal hd256", "bf16", 1, 1500, 1500, 4, 2, 256, 256, {"causal": True}),
    ("bf16 window hd256", "bf16", 1, 1500, 1500, 4, 2, 256, 256, {"window": (200, 0)}),
)
# The benchmark's shapes (`python -m jzyfa.bench`'s grid and extra cells), with --bench_shapes.
BENCH_CASES = tuple(
    (f"{dtype} causal hd128 {b}x{s}", dtype, b, s, s, 16, 16, 128, 128, {"causal": True})
    for dtype in ("bf16", "fp8")
    for b, s in ((16, 1024), (4, 4096), (1, 16384), (1, 32768))
) + (
    ("bf16 nocausal hd128 4x4096", "bf16", 4, 4096, 4096, 16, 16, 128, 128, {}),
    ("fp8 nocausal hd128 4x4096", "fp8", 4, 4096, 4096, 16, 16, 128, 128, {}),
    ("bf16 causal gqa32/8 1x16384", "bf16", 1, 16384, 16384, 32, 8, 128, 128, {"causal": True}),
    ("fp8 causal gqa32/8 1x16384", "fp8", 1, 16384, 16384, 32, 8, 128, 128, {"causal": True}),
    ("bf16 causal hd64 4x4096", "bf16", 4, 4096, 4096, 32, 32, 64, 64, {"causal": True}),
    ("bf16 causal hd256 4x4096", "bf16", 4, 4096, 4096, 8, 8, 256, 256, {"causal": True}),
    ("bf16 causal mla 2x4096", "bf16", 2, 4096, 4096, 16, 16, 192, 128, {"causal": True}),
    ("fp8 exact causal hd128 2x8192", "fp8", 2, 8192, 8192, 16, 16, 128, 128, {"causal": True, "lean_p": False}),
)
# (name, dtype, sequence lengths, heads_q, heads_kv, options)
VARLEN_CASES = (
    ("bf16 varlen causal", "bf16", (700, 1300, 64, 5), 4, 2, {"causal": True}),
    ("fp8 varlen causal", "fp8", (700, 1300, 64, 5), 4, 2, {"causal": True}),
    ("bf16 varlen window", "bf16", (700, 1300, 64, 5), 4, 2, {"window": (100, 20)}),
    ("fp8 varlen window", "fp8", (700, 1300, 64, 5), 4, 2, {"window": (100, 0)}),
    ("fp8 varlen transposed", "fp8", (9000, 300), 4, 2, {"causal": True}),
)


def digest(out: np.ndarray, lse: np.ndarray) -> str:
    """'O <hash> LSE <hash> |O|^2 <value>' of the arrays' bytes."""

    def short(a: np.ndarray) -> str:
        return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]

    square_sum = float(np.sum(np.square(out.astype(np.float64))))
    return f"O {short(out)} LSE {short(lse)} |O|^2 {square_sum:.9e}"


def _inputs(key, shapes, dtype: str):
    """Gaussian inputs, and for fp8 their quantized form and descales (flash_attention's keywords)."""
    import jax
    import jax.numpy as jnp

    import jzyfa

    keys = jax.random.split(key, len(shapes))
    xs = [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]
    if dtype == "fp8":
        quantized = [jzyfa.fp8_quantize(x) for x in xs]
        descales = dict(zip(("descale_q", "descale_k", "descale_v"), (d for _, d in quantized)))
        return [x for x, _ in quantized], descales
    return [x.astype({"bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]) for x in xs], {}


def calls(
    implementation: str, seed: int, bench_shapes: bool = False
) -> Iterator[tuple[str, Callable[[], tuple]]]:
    """(name, a function returning (O, LSE)) for every configuration (and the benchmark's shapes)."""
    import jax
    import jax.numpy as jnp

    import jzyfa

    base = jax.random.key(seed)
    cases = DENSE_CASES + (BENCH_CASES if bench_shapes else ())
    for i, (name, dtype, b, sq, sk, hq, hkv, d, dv, options) in enumerate(cases):
        shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv))
        (q, k, v), descales = _inputs(jax.random.fold_in(base, i), shapes, dtype)

        def dense(q=q, k=k, v=v, descales=descales, options=options):
            fn = jax.jit(
                lambda q, k, v, ds: jzyfa.flash_attention(
                    q, k, v, return_lse=True, implementation=implementation, **options, **ds
                )
            )
            return fn(q, k, v, descales)

        yield name, dense
    for i, (name, dtype, lengths, hq, hkv, options) in enumerate(VARLEN_CASES):
        total = sum(lengths)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
        shapes = ((total, hq, 128), (total, hkv, 128), (total, hkv, 128))
        (q, k, v), descales = _inputs(jax.random.fold_in(base, 100 + i), shapes, dtype)

        def varlen(q=q, k=k, v=v, descales=descales, options=options, top=max(lengths)):
            fn = jax.jit(
                lambda q, k, v, cu, ds: jzyfa.flash_attention_varlen(
                    q, k, v, cu, cu, top, top, return_lse=True, implementation=implementation, **options, **ds
                )
            )
            return fn(q, k, v, cu, descales)

        yield name, varlen


def compare(lines: Sequence[str]) -> list[str]:
    """Configurations whose digests differ between the 'A ' and 'B ' lines of a log."""
    by_build: dict[str, dict[str, str]] = {"A": {}, "B": {}}
    for line in lines:
        build, _, rest = line.partition(" ")
        if build in by_build and ": O " in rest:
            name, _, value = rest.partition(": ")
            by_build[build][name] = value.strip()
    a, b = by_build["A"], by_build["B"]
    return [f"{name}: A {a.get(name)} | B {b.get(name)}" for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--implementation", default="kernel", choices=("kernel", "xla"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bench_shapes", action="store_true", help="also the benchmark's shapes")
    parser.add_argument("--only", default="", help="run only configurations whose name contains this")
    parser.add_argument("--compare", default="", help="a log holding 'A ...' and 'B ...' lines: print differences")
    args = parser.parse_args(argv)
    if args.compare:
        with open(args.compare) as f:
            differences = compare(f.read().splitlines())
        print("\n".join(differences) if differences else "A and B digests agree")
        raise SystemExit(1 if differences else 0)
    for name, call in calls(args.implementation, args.seed, args.bench_shapes):
        if args.only not in name:
            continue
        out, lse = call()
        out = np.asarray(out.astype("float32"))
        lse = np.asarray(lse)
        finite = bool(np.isfinite(out).all())
        print(f"{name}: {digest(out, lse)}{'' if finite else ' NONFINITE'}", flush=True)


if __name__ == "__main__":
    main()
