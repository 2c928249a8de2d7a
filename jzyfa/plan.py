"""Which kernel serves a call: one table from a call's configuration to a kernel, or the reason none does.

A configuration is (dtype family, head dims, mask kind, layout, direction). `KERNELS` lists the ones
the compiled extension has an instantiation for (ffi/tile_size.h holds the same list; `kernels()` of the
built extension must equal it, which a test checks). Dispatch (`jzyfa.api`), the errors of
`implementation="kernel"`, the README's support matrix (`support_matrix_markdown`) and the kernel tests'
parameters all come from this table. A kernel that has not passed its GPU tests is not in it.

Beyond the table, `call_problem` holds the launch limits (int32 tile indices, token counts) that depend
on a call's sizes, and the FP8 kernel's two per-call choices, also made here at trace time: where V's
operand layout is built (`fp8_value_layout`) and how many keys a block holds (`fp8_key_block`).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import os

from jzyfa import _extension

FAMILIES = ("16bit", "fp8", "int8")  # int8: precision="int8"'s int8 q and k with e4m3 v
MASKS = ("none", "causal", "window")
LAYOUTS = ("dense", "varlen")
DIRECTIONS = ("fwd", "bwd")
MLA_HEAD_DIMS = (192, 128)


@dataclasses.dataclass(frozen=True, order=True)
class Config:
    """A call's configuration as the table keys it."""

    family: str  # "16bit" (bf16, f16) or "fp8" (float8_e4m3fn)
    head_dims: tuple[int, int]  # (q and k, v and out)
    mask: str  # "none", "causal" or "window" (a sliding window that is neither)
    layout: str  # "dense" [batch, seq, heads, dim] or "varlen" (packed [tokens, heads, dim])
    direction: str = "fwd"

    def as_tuple(self) -> tuple:
        """The form the extension's `kernels()` lists: (family, dim_qk, dim_v, mask, layout, direction)."""
        return (self.family, *self.head_dims, self.mask, self.layout, self.direction)


def _rows(family: str, head_dims, masks, layouts, direction: str = "fwd") -> tuple[Config, ...]:
    return tuple(
        Config(family, dims, mask, layout, direction)
        for dims, mask, layout in itertools.product(head_dims, masks, layouts)
    )


# The table. Each row is an instantiation in ffi/ that has passed its GPU tests (tests/test_*_gpu.py).
KERNELS: frozenset[Config] = frozenset(
    _rows("16bit", [(64, 64), (128, 128), (256, 256), MLA_HEAD_DIMS], MASKS, LAYOUTS)
    + _rows("fp8", [(64, 64), (128, 128)], MASKS, LAYOUTS)
    + _rows("fp8", [(256, 256)], MASKS, ("dense",))
    + _rows("fp8", [MLA_HEAD_DIMS], ("none", "causal"), ("dense",))
    + _rows("16bit", [(64, 64), (128, 128), (256, 256), MLA_HEAD_DIMS], MASKS, LAYOUTS, "bwd")
    + _rows("int8", [(128, 128)], MASKS, ("dense",))
    + _rows("int8", [MLA_HEAD_DIMS], ("none", "causal"), ("dense",))
)

# Built in ffi/ (ffi/tile_size.h's kFwdKernels) but not served yet: rows whose GPU tests have not all
# passed. Calls with these configurations run the pure-JAX path; their GPU tests add the rows for
# themselves (tests/plan_rows.py). docs/benchmarks.md says what ran of them.
BUILT_AWAITING_GPU_TESTS: frozenset[Config] = frozenset(
    _rows("fp8", [(256, 256)], MASKS, ("varlen",))
    + _rows("int8", [(256, 256)], MASKS, ("dense",))
    + _rows("int8", [(128, 128)], MASKS, ("varlen",))
)

# Exact probabilities (lean_p=False) exist for dense FP8 calls; varlen FP8 calls always use lean P.
EXACT_P_LAYOUTS = ("dense",)


def kernel_for(config: Config) -> Config | None:
    """The table's row for `config`, or None."""
    return config if config in KERNELS else None


def config_problem(config: Config) -> str | None:
    """None when the table has `config`, else a sentence saying what the kernels do take."""
    if config in KERNELS:
        return None
    family_rows = [
        row for row in KERNELS if row.family == config.family and row.direction == config.direction
    ]
    if not family_rows:
        return f"jzyfa has no {_DIRECTION_NAMES[config.direction]} kernel for {_family_name(config.family)} inputs"
    dims = sorted({row.head_dims for row in family_rows})
    if config.head_dims not in dims:
        listed = ", ".join(f"{a}/{b}" for a, b in dims)
        return (
            f"the {_family_name(config.family)} kernels take head dims (q and k / v) {listed}, "
            f"got {config.head_dims[0]}/{config.head_dims[1]}"
        )
    rows = [row for row in family_rows if row.head_dims == config.head_dims]
    masks = sorted({row.mask for row in rows if row.layout == config.layout}, key=MASKS.index)
    if not masks:
        return (
            f"the {_family_name(config.family)} kernels have no {config.layout} layout at head dims "
            f"{config.head_dims[0]}/{config.head_dims[1]}"
        )
    return (
        f"the {_family_name(config.family)} kernel at head dims {config.head_dims[0]}/{config.head_dims[1]} "
        f"({config.layout}) takes masks {', '.join(masks)}, not a {config.mask!r} mask"
    )


_DIRECTION_NAMES = {"fwd": "forward", "bwd": "backward"}


def _family_name(family: str) -> str:
    return {"16bit": "16-bit (bf16, f16)", "fp8": "FP8 (e4m3)", "int8": "INT8 (int8 q and k, e4m3 v)"}[family]


# ---- launch limits that depend on a call's sizes (ffi/ checks the same before launching)

KERNEL_MAX_BATCH = 65535
KERNEL_MAX_SEQ_Q = 65535 * 128
KERNEL_MAX_TOKENS = 1 << 30
KERNEL_MAX_TILES = 1 << 30
WINDOW_MAX_TOKENS = 1 << 30  # the windowed kernels compute positions in int32
FP8_VARLEN_MAX_VALUE_KEYS = (1 << 31) - 1024  # V^T's columns stay int32 (varlen, transposed)


@dataclasses.dataclass(frozen=True)
class CallSizes:
    """The sizes of a validated call the launch limits read. Dense: batch, seq_q, seq_k; varlen:
    num_seqs, the maxima as seq_q / seq_k and the packed token counts."""

    layout: str
    batch: int  # dense batch, or varlen num_seqs
    seq_q: int  # dense seq_q, or varlen max_seqlen_q
    seq_k: int
    heads_q: int
    heads_kv: int
    total_q: int = 0  # varlen only
    total_k: int = 0


def surely(predicate) -> bool:
    """predicate() for concrete sizes; False where symbolic sizes (jax.export's shape polymorphism)
    leave it undecidable, so an undecidable launch limit takes the kernel path (the FFI handler
    checks the launch limits itself on the concrete sizes)."""
    try:
        return bool(predicate())
    except Exception as error:  # jax's InconclusiveDimensionOperation, not in the public API
        if any(cls.__name__ == "InconclusiveDimensionOperation" for cls in type(error).__mro__):
            return False
        raise


def call_problem(config: Config, sizes: CallSizes, softmax_scale: float) -> str | None:
    """None when a kernel serves this validated call, else why not: the table, then the limits."""
    if problem := config_problem(config):
        return problem
    if not softmax_scale > 0:
        return f"the kernels need softmax_scale > 0, got {softmax_scale}"
    if sizes.layout == "dense":
        if surely(lambda: sizes.batch > KERNEL_MAX_BATCH):
            return f"the kernels take batch <= {KERNEL_MAX_BATCH}, got {sizes.batch}"
        if surely(lambda: sizes.seq_q > KERNEL_MAX_SEQ_Q):
            return f"the kernels take seq_q <= {KERNEL_MAX_SEQ_Q}, got {sizes.seq_q}"
        if surely(lambda: sizes.seq_q == 0 or sizes.seq_k == 0):
            return f"the kernels need seq_q and seq_k >= 1, got {sizes.seq_q} and {sizes.seq_k}"
        tokens = sizes.seq_q + sizes.seq_k
    else:
        if surely(lambda: sizes.total_q == 0 or sizes.total_k == 0):
            return f"the kernels need total_q and total_k >= 1, got {sizes.total_q} and {sizes.total_k}"
        if surely(lambda: max(sizes.total_q, sizes.total_k) > KERNEL_MAX_TOKENS):
            return f"the kernels take at most {KERNEL_MAX_TOKENS} tokens, got {max(sizes.total_q, sizes.total_k)}"
        tiles = (sizes.batch + 1) * -(-sizes.seq_q // 128) * sizes.heads_q
        if surely(lambda: tiles > KERNEL_MAX_TILES):
            return (
                f"the kernels take (num_seqs + 1) * ceil(max_seqlen_q / 128) * heads_q <= 2^30, got {tiles}"
            )
        tokens = sizes.total_q + sizes.total_k
        if config.family == "fp8" and (
            fp8_varlen_value_layout(sizes.seq_q, sizes.heads_q, sizes.heads_kv, head_dim=config.head_dims[0])
            == "transposed"
        ):
            keys = _varlen_padded_keys(sizes.total_k, sizes.batch)
            if surely(lambda: keys > FP8_VARLEN_MAX_VALUE_KEYS):
                return (
                    "the FP8 varlen kernel takes total_k + 32 * (num_seqs + 1) < 2^31 - 1024 (V^T's "
                    f"columns), got {sizes.total_k} keys"
                )
    if config.mask == "window" and surely(lambda: tokens > WINDOW_MAX_TOKENS):
        what = "seq_q + seq_k" if sizes.layout == "dense" else "total_q + total_k"
        return f"the kernels' sliding windows take {what} <= 2^30, got {tokens}"
    return None


def _varlen_padded_keys(total_k: int, num_seqs: int) -> int:
    """V^T's key columns of a varlen FP8 call (jzyfa.fp8_layout.varlen_padded_keys)."""
    return -(-total_k // 32) * 32 + 32 * (num_seqs + 1)


# ---- which path serves a call


class Path(enum.Enum):
    REFERENCE = "reference"  # pure JAX, no primitive
    PRIMITIVE = "primitive"  # the kernel on Hopper; the primitive's CPU lowering elsewhere
    KERNEL_REQUIRED = "kernel_required"  # the primitive, and lowering anywhere but CUDA is an error
    CUDNN = "cudnn"  # jax.nn.dot_product_attention(implementation="cudnn"): CUDA GPUs without the kernel


HOPPER_COMPUTE_CAPABILITY = "9.0"


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices a call is traced for, as routing reads them (`jzyfa._platform.target()` builds it
    from the default backend's devices; `Target.of` from given facts, for tests and tools)."""

    backend: str  # jax.default_backend(): "cpu", "gpu", "tpu"
    kernel_problem: str | None  # None where jzyfa's kernel runs on every device, else why not
    compute_capability: str | None = None  # CUDA GPUs: the lowest of the devices', e.g. "8.9"
    cudnn_version: int | None = None  # CUDA GPUs: cuDNN's version (e.g. 90800), None if not found

    @classmethod
    def of(
        cls,
        backend: str,
        compute_capability: str | None = None,
        *,
        extension_error: str | None = None,
        cudnn_version: int | None = None,
    ) -> Target:
        """The target of `backend`'s devices: the kernel runs on a Hopper GPU (compute capability 9.0)
        whose extension loaded (`extension_error` None)."""
        if backend != "gpu":
            problem = f"the default JAX backend is {backend!r}, not a CUDA GPU"
        elif compute_capability != HOPPER_COMPUTE_CAPABILITY:
            problem = (
                f"the GPU has compute capability {compute_capability}, the kernel needs Hopper "
                f"({HOPPER_COMPUTE_CAPABILITY})"
            )
        else:
            problem = extension_error
        return cls(backend, problem, compute_capability, cudnn_version)


def default_path(
    problem: str | None, cudnn_problem: str | None, target: Target, *, cpu_primitive: bool
) -> Path:
    """The path of `implementation=None` for a validated call on `target`: jzyfa's kernel where it
    serves the call (`problem`, from `call_problem`) and runs on the devices; on a CUDA GPU without
    it, cuDNN's fused attention where that serves the call (`cudnn_problem`, from
    `jzyfa.cudnn.problem`); the pure-JAX path otherwise. On a CPU backend, calls the kernel would
    serve bind the primitive when `cpu_primitive` (its CPU lowering is the reference), so that the
    same program lowers for CUDA too."""
    if problem is None and (target.kernel_problem is None or (cpu_primitive and target.backend == "cpu")):
        return Path.PRIMITIVE
    if target.kernel_problem is not None and cudnn_problem is None:
        return Path.CUDNN
    return Path.REFERENCE


def choose_path(
    problem: str | None, implementation: str | None, *, cpu_primitive: bool, cudnn_call=None
) -> Path:
    """The path for a validated call whose kernel problem (`call_problem`) is `problem`.

    "xla" is the pure-JAX path; "kernel" raises naming what the kernel cannot serve, or why it cannot
    run here (a GPU that is not Hopper); None follows `default_path` on the default backend's devices
    (`cudnn_call`, a `jzyfa.cudnn.Call`, says what cuDNN would have to serve; None: not a cuDNN call).
    `cpu_primitive`: on a CPU backend the primitive still runs (its CPU lowering), so that the same
    program lowers for CUDA too (16-bit calls; FP8 calls on CPU take the exact pure-JAX path).
    """
    from jzyfa import _platform, cudnn  # noqa: PLC0415 - _platform imports jax devices lazily

    if implementation == "xla":
        return Path.REFERENCE
    if implementation == "kernel":
        if problem:
            raise ValueError(f"implementation='kernel' cannot serve this call: {problem}")
        if _platform.default_backend() == "gpu" and (reason := _platform.hopper_unavailable_reason()):
            raise ValueError(f"implementation='kernel' cannot run here: {reason}")
        return Path.KERNEL_REQUIRED
    target = _platform.target()
    cudnn_problem = "not a call cuDNN takes" if cudnn_call is None else cudnn.problem(cudnn_call, target)
    return default_path(problem, cudnn_problem, target, cpu_primitive=cpu_primitive)


# ---- the FP8 kernel's per-call choices: V's operand layout and keys per block
#
# V's operand layout: "staged" (the kernel takes V as it is and transposes each tile in shared memory)
# or "transposed" (a layout kernel writes V^T to memory first, and the FP8 kernel TMA-loads it).
# Measured on the H200 (whole call, docs/fp8.md): the layout pass costs one pass over V's bytes; the
# staged kernel is ~4-6% slower per key block. So the query rows that share one KV head's V decide:
# staged up to FP8_STAGED_V_MAX_ROWS of them (dense; break-even measured at 4096), else transposed; and
# transposed for those few rows too when they see enough keys that the kernel with V^T runs 192-key
# blocks (a prefill chunk against a long cache), which the staged kernel does not have. Varlen calls
# pay more for V^T (a gather of token rows first), so their threshold is higher. The staged kernel
# transposes V rows of 128 bytes only: at head dims 64 and 256 V^T always comes from memory (q/k head dims whose
# v has 128 columns: FP8_STAGED_V_HEAD_DIMS).
FP8_STAGED_V_HEAD_DIMS = (128, MLA_HEAD_DIMS[0])
FP8_STAGED_V_MAX_ROWS = 2048
FP8_VARLEN_STAGED_V_MAX_ROWS = 8192
FP8_V_LAYOUTS = ("staged", "transposed")
# Overrides for tests and A/B measurements, read when a call is traced (a function already traced for
# the same shapes keeps its choice until `jax.clear_caches()`); any other non-empty value raises.
FP8_V_LAYOUT_ENV = "JZYFA_FP8_V_LAYOUT"  # "staged" | "transposed"
FP8_KEY_BLOCK_ENV = "JZYFA_FP8_KEY_BLOCK"  # "auto" | "128" | "192"
FP8_KEY_BLOCKS = ("auto", "128", "192")
FP8_WIDE_KEY_BLOCK = 192


def _env_choice(name: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, "")
    if value and value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)} (or unset), got {value!r}")
    return value


def fp8_key_block_override() -> int:
    """JZYFA_FP8_KEY_BLOCK as the kernel's key_block attribute: 0 (the launch's rule), 128 or 192."""
    value = _env_choice(FP8_KEY_BLOCK_ENV, FP8_KEY_BLOCKS)
    return 0 if value in ("", "auto") else int(value)


def fp8_key_block_attribute(
    *, v_transposed: bool, head_dims: tuple[int, int], windowed: bool, layout: str
) -> int:
    """The key_block attribute a call passes: the override where a forced block exists (dense,
    head dim 128, no window, V^T from memory: 128 or 192 keys), else 0 (the launch's rule)."""
    override = fp8_key_block_override()
    applies = layout == "dense" and v_transposed and head_dims == (128, 128) and not windowed
    return override if applies else 0


def fp8_key_block_for(
    *, v_transposed: bool, head_dim: int, causal: bool, window: tuple[int, int], seq_q: int, seq_k: int
) -> int:
    """Keys per block of the dense FP8 kernel for these properties: the override where it applies, else
    the extension's rule (128, or 192 with V^T when rows see many keys); 128 without the extension."""
    forced = fp8_key_block_attribute(
        v_transposed=v_transposed,
        head_dims=(head_dim, head_dim),
        windowed=tuple(window) not in ((-1, -1), (-1, 0)),
        layout="dense",
    )
    if forced:
        return forced
    return _extension.fp8_key_block(
        v_transposed=v_transposed, head_dim=head_dim, causal=causal, window=window, seq_q=seq_q, seq_k=seq_k
    )


def _layout_by_rows(rows: int, max_staged_rows: int, head_dim: int = 128) -> str:
    if head_dim not in FP8_STAGED_V_HEAD_DIMS:
        return "transposed"  # no staged kernel at this head dim, whatever the override
    if override := _env_choice(FP8_V_LAYOUT_ENV, FP8_V_LAYOUTS):
        return override
    return "staged" if rows <= max_staged_rows else "transposed"


def fp8_value_layout(
    seq_q: int, heads_q: int, heads_kv: int, *, seq_k: int, head_dim: int, causal: bool, window
) -> str:
    """ "staged" or "transposed" for one shard of a dense FP8 call (the rule above). `window` is the
    mask as the primitive holds it (causal folded in: (-1, 0) causal, (-1, -1) none)."""
    layout = _layout_by_rows(seq_q * (heads_q // heads_kv), FP8_STAGED_V_MAX_ROWS, head_dim)
    if layout == "staged" and not _env_choice(FP8_V_LAYOUT_ENV, FP8_V_LAYOUTS):
        wide = fp8_key_block_for(
            v_transposed=True, head_dim=head_dim, causal=causal, window=window, seq_q=seq_q, seq_k=seq_k
        )
        if wide > 128:
            return "transposed"
    return layout


def int8_value_layout(seq_q: int, heads_q: int, heads_kv: int, *, head_dim: int = 128) -> str:
    """ "staged" or "transposed" for one shard of a dense INT8 call: the FP8 rule by rows (the INT8 kernel
    has no wide blocks, so no wide-block exception); V^T always at head dim 256."""
    return _layout_by_rows(seq_q * (heads_q // heads_kv), FP8_STAGED_V_MAX_ROWS, head_dim)


def fp8_varlen_value_layout(max_seqlen_q: int, heads_q: int, heads_kv: int, *, head_dim: int = 128) -> str:
    """The same for a packed varlen FP8 call, on the longest sequence's rows."""
    return _layout_by_rows(max_seqlen_q * (heads_q // heads_kv), FP8_VARLEN_STAGED_V_MAX_ROWS, head_dim)


def fp8_key_block(q_shape, k_shape, *, causal: bool, window=None) -> int:
    """Keys per block of the dense FP8 kernel that a call with q, k of these shapes ([batch, seq, heads,
    head_dim]) runs: its emulation (`jzyfa.fp8_emulation`, `block_n`) must use the same blocks to follow
    the kernel's block scaling. 128 without the extension."""
    from jzyfa import _validation  # noqa: PLC0415

    window = _validation.mask_window(bool(causal), _validation.check_window(window))
    (_, seq_q, heads_q, head_dim), (_, seq_k, heads_kv, _) = q_shape, k_shape
    keys = dict(seq_k=seq_k, head_dim=head_dim, causal=causal, window=window)
    v_transposed = fp8_value_layout(seq_q, heads_q, heads_kv, **keys) == "transposed"
    return fp8_key_block_for(v_transposed=v_transposed, seq_q=seq_q, **keys)


# ---- the support matrix, for the README


def support_matrix_markdown() -> str:
    """The README's support matrix, generated from `KERNELS` (tools/support_matrix.py writes it)."""
    lines = [
        "| inputs | head dims (q·k / v) | layouts | masks | directions |",
        "|---|---|---|---|---|",
    ]
    groups: dict[tuple, set] = {}
    for row in sorted(KERNELS):
        key = (row.family, row.head_dims, row.layout, row.direction)
        groups.setdefault(key, set()).add(row.mask)
    merged: dict[tuple, list[str]] = {}
    for (family, dims, layout, direction), masks in sorted(groups.items()):
        key = (family, dims, tuple(sorted(masks, key=MASKS.index)), direction)
        merged.setdefault(key, []).append(layout)
    # One line per (family, head dims, masks, layouts), its directions together.
    lines_by_call: dict[tuple, list[str]] = {}
    for (family, dims, masks, direction), layouts in merged.items():
        lines_by_call.setdefault((family, dims, masks, tuple(layouts)), []).append(direction)
    for (family, dims, masks, layouts), directions in lines_by_call.items():
        inputs = {
            "16bit": "bf16, f16",
            "fp8": "float8_e4m3fn (bf16 out)",
            "int8": 'bf16, f16 with precision="int8" (int8 q and k, e4m3 v)',
        }[family]
        lines.append(
            f"| {inputs} | {dims[0]} / {dims[1]} | {', '.join(layouts)} | {', '.join(masks)} | "
            f"{', '.join(_DIRECTION_NAMES[d] for d in sorted(directions, key=DIRECTIONS.index))} |"
        )
    return "\n".join(lines)
