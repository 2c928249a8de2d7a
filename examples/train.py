"""Trains a small byte-level causal LM on the Python standard library's source, attention by jzyfa.

The model is examples/lm.py's (examples/prefill.py's transformer over 256 byte values, head dim 128,
GQA, float32 master weights, bf16 activations); the text is examples/stdlib_text.py's. Training is
AdamW with linear warmup and cosine decay, gradient clipping by global norm, one jitted step
(value_and_grad, parameters and optimizer state donated). Every run is deterministic given `--seed`:
the seed draws both the initial weights and the training windows.

    python examples/train.py                                 # --preset cpu: seconds on a CPU
    python examples/train.py --compare xla                   # the same run with jax.nn's XLA attention
    python examples/train.py --preset h200 --attention cudnn --save lm.npz   # the checkpoint
    python examples/train.py --preset h200 --compare cudnn --steps 100       # jzyfa next to cuDNN
    python examples/train.py --preset h200 --load lm.npz --steps 0           # held-out loss of a checkpoint

It prints loss, learning rate, gradient norm, tokens/s and step time every `--log-every` steps, then
the held-out loss in nats and bits per byte (zlib's bits per byte on the same text for scale). With
`--compare NAME` it trains the same model on the same windows with the other attention and prints
the two side by side, with the largest difference between their loss curves.

Preset h200, sized by arithmetic (docs/training.md has what ran on a GPU): 8 layers, d_model 1024,
8 query and 2 KV heads of dim 128, gated MLP 2816: about 90M parameters outside the embeddings.
Windows of 4096 bytes, 32 a step: 131K tokens a step rather than 256K, because without
rematerialisation a 256K-token step's activations would take about 100 GB of the H200's 141 GB, and
twice the optimizer steps in the same time take a model this small further. A step costs about
6 x 90M FLOP a token in the matmuls plus 3.5 x 8.4M a token a layer in causal attention, about
1.0e14 FLOP: about 0.3 s at 300-400 TFLOP/s. 600 steps (79M bytes, about 2.6 passes over Python
3.12's 30 MB training split) should then take about 3 minutes plus compilation with cuDNN attention.
Expected result: from ln 256 = 5.5 nats (8 bits) per byte down to around 1 bit per byte on the
held-out files, clearly below zlib's bits per byte on the same text (about 1.6 for Python 3.12's).
With `--attention jzyfa` the gradient runs jzyfa's backward kernels (head dim 128 is in the plan),
about half as fast as cuDNN's backward (README, Limits).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # examples/lm.py and its neighbours
import lm
import prefill
import stdlib_text


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int
    learning_rate: float  # peak, reached at the end of the warmup
    warmup: int
    final_lr_fraction: float = 0.1  # the cosine decays to this fraction of the peak
    weight_decay: float = 0.1  # on matrices and embeddings, not on the norms' gains
    clip_norm: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8
    eval_batches: int = 4  # held-out batches, of the training batch's shape
    log_every: int = 10


# The model sizes of each preset (Config's batch and seq are the training windows) and how it trains.
CPU_MODEL = prefill.Config(
    batch=4, seq=256, layers=2, d_model=256, heads_q=2, heads_kv=1, head_dim=128, mlp=512, vocab=lm.VOCAB
)
H200_MODEL = dataclasses.replace(
    CPU_MODEL, batch=32, seq=4096, layers=8, d_model=1024, heads_q=8, heads_kv=2, mlp=2816
)
PRESETS = {
    "cpu": (CPU_MODEL, TrainConfig(steps=20, learning_rate=3e-3, warmup=4, eval_batches=2, log_every=5)),
    "h200": (H200_MODEL, TrainConfig(steps=600, learning_rate=6e-4, warmup=60, eval_batches=8, log_every=20)),
}


def learning_rate(step: jax.Array, train: TrainConfig) -> jax.Array:
    """Linear warmup to the peak, then cosine decay to final_lr_fraction of it at the last step."""
    warmup = (step + 1) / max(train.warmup, 1)
    progress = jnp.clip((step - train.warmup) / max(train.steps - train.warmup - 1, 1), 0.0, 1.0)
    cosine = train.final_lr_fraction + (1 - train.final_lr_fraction) * 0.5 * (1 + jnp.cos(math.pi * progress))
    return train.learning_rate * jnp.where(step < train.warmup, warmup, cosine)


def adamw_init(params: dict) -> dict:
    zeros = functools.partial(jax.tree.map, jnp.zeros_like)
    return {"step": jnp.zeros((), jnp.int32), "mean": zeros(params), "square": zeros(params)}


def adamw_update(params: dict, grads: dict, state: dict, train: TrainConfig) -> tuple[dict, dict]:
    step = state["step"]
    lr = learning_rate(step, train)
    mean = jax.tree.map(lambda m, g: train.beta1 * m + (1 - train.beta1) * g, state["mean"], grads)
    square = jax.tree.map(lambda s, g: train.beta2 * s + (1 - train.beta2) * g * g, state["square"], grads)
    unbias_mean, unbias_square = 1 - train.beta1 ** (step + 1), 1 - train.beta2 ** (step + 1)

    def update(path, w, m, s):
        decay = 0.0 if "norm" in jax.tree_util.keystr(path) else train.weight_decay
        adam = (m / unbias_mean) / (jnp.sqrt(s / unbias_square) + train.epsilon)
        return w - lr * (adam + decay * w)

    params = jax.tree_util.tree_map_with_path(update, params, mean, square)
    return params, {"step": step + 1, "mean": mean, "square": square}


def clip_by_global_norm(grads: dict, max_norm: float) -> tuple[dict, jax.Array]:
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * scale, grads), norm


# Module-level jits with the configs static, so a second run with the same sizes and attention (the
# tests' reruns) reuses the compiled step.
@functools.partial(
    jax.jit, static_argnames=("config", "train", "attention"), donate_argnames=("params", "opt")
)
def train_step(params, opt, windows, *, config: prefill.Config, train: TrainConfig, attention: str):
    loss, grads = jax.value_and_grad(lm.next_byte_loss, argnums=1)(config, params, windows, attention)
    grads, grad_norm = clip_by_global_norm(grads, train.clip_norm)
    params, opt = adamw_update(params, grads, opt, train)
    return params, opt, {"loss": loss, "grad_norm": grad_norm, "lr": learning_rate(opt["step"] - 1, train)}


held_out_loss_step = jax.jit(lm.next_byte_loss, static_argnums=(0, 3))


def held_out_loss(
    config: prefill.Config, params: dict, held_out: np.ndarray, batches: int, attention: str
) -> float:
    # At most as many batches as the held-out bytes fill without overlap (Python 3.12's held-out files
    # fill 3 of the h200 preset's 32 windows of 4097 bytes); not even one raises, naming the sizes.
    batches = max(1, min(batches, len(held_out) // (config.batch * (config.seq + 1))))
    windows = stdlib_text.evenly_spaced_windows(held_out, batches * config.batch, config.seq + 1)
    losses = [held_out_loss_step(config, params, batch, attention) for batch in np.split(windows, batches)]
    return float(np.mean(jax.device_get(losses)))


def train(
    config: prefill.Config,
    train_cfg: TrainConfig,
    corpus: stdlib_text.Corpus,
    *,
    attention: str = "jzyfa",
    seed: int = 0,
    params: dict | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Trains from `params` (or from weights drawn with `seed`); returns the loss curve, the final
    parameters, throughput and held-out loss."""
    params = lm.init_params(config, jax.random.key(seed)) if params is None else params
    params = jax.tree.map(jnp.array, params)  # a private copy: the step donates its inputs
    opt = adamw_init(params)
    rng = np.random.default_rng(seed)
    tokens_per_step = config.batch * config.seq
    losses, step_times = [], []
    for step in range(train_cfg.steps):
        windows = stdlib_text.random_windows(corpus.train, rng, config.batch, config.seq + 1)
        start = time.perf_counter()
        params, opt, metrics = train_step(
            params, opt, windows, config=config, train=train_cfg, attention=attention
        )
        metrics = jax.device_get(metrics)  # waits for the step: the time below is the step's own
        step_times.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"]))
        if step % train_cfg.log_every == 0 or step == train_cfg.steps - 1:
            note = "  (includes compilation)" if step == 0 else ""
            log(
                f"[{attention}] step {step:5d}/{train_cfg.steps}  loss {losses[-1]:.4f}  lr {metrics['lr']:.2e}  "
                f"|grad| {metrics['grad_norm']:.3f}  {tokens_per_step / step_times[-1]:12,.0f} tokens/s  "
                f"{1e3 * step_times[-1]:8.1f} ms/step{note}"
            )
    steady = step_times[1:] or step_times  # the first step compiles
    held_out = held_out_loss(config, params, corpus.held_out, train_cfg.eval_batches, attention)
    return {
        "attention": attention,
        "losses": losses,
        "params": params,
        "tokens_per_second": tokens_per_step * len(steady) / sum(steady) if steady else float("nan"),
        "step_seconds": float(np.median(steady)) if steady else float("nan"),
        "held_out_loss": held_out,
        "held_out_bits_per_byte": held_out / math.log(2),
    }


def print_comparison(a: dict, b: dict, log_every: int) -> float:
    """Prints two runs side by side; returns the largest difference between their loss curves."""
    name_a, name_b = a["attention"], b["attention"]
    print(f"\n{'step':>6} {'loss ' + name_a:>14} {'loss ' + name_b:>14} {'difference':>12}")
    for step, (loss_a, loss_b) in enumerate(zip(a["losses"], b["losses"])):
        if step % log_every == 0 or step == len(a["losses"]) - 1:
            print(f"{step:6d} {loss_a:14.4f} {loss_b:14.4f} {loss_a - loss_b:12.2e}")
    for label, key, form in [
        ("tokens/s", "tokens_per_second", ",.0f"),
        ("median step s", "step_seconds", ".4f"),
        ("held-out nats/byte", "held_out_loss", ".4f"),
        ("held-out bits/byte", "held_out_bits_per_byte", ".4f"),
    ]:
        print(f"{label:>20} {a[key]:{form}} ({name_a})  {b[key]:{form}} ({name_b})")
    max_diff = max((abs(x - y) for x, y in zip(a["losses"], b["losses"])), default=0.0)
    print(f"max |loss({name_a}) - loss({name_b})| over {len(a['losses'])} steps: {max_diff:.3e}")
    return max_diff


def add_dataclass_flags(parser: argparse.ArgumentParser, defaults) -> None:
    for field in dataclasses.fields(defaults):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(
            flag, type=type(getattr(defaults, field.name)), help=f"overrides the preset's {field.name}"
        )


def from_flags(args: argparse.Namespace, defaults):
    return dataclasses.replace(
        defaults,
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(defaults)
            if getattr(args, f.name) is not None
        },
    )


def parse_args(argv: list[str] | None) -> tuple[prefill.Config, TrainConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=PRESETS, default="cpu", help="sizes to start from")
    add_dataclass_flags(parser, PRESETS["cpu"][0])
    add_dataclass_flags(parser, PRESETS["cpu"][1])
    parser.add_argument("--attention", choices=lm.ATTENTIONS, default="jzyfa")
    parser.add_argument(
        "--compare", choices=lm.ATTENTIONS, help="also train with this attention, side by side"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="draws the initial weights and the training windows"
    )
    parser.add_argument("--save", type=pathlib.Path, help="write the trained parameters here (.npz)")
    parser.add_argument("--load", type=pathlib.Path, help="start from this checkpoint (its model sizes win)")
    args = parser.parse_args(argv)
    model, training = PRESETS[args.preset]
    return from_flags(args, model), from_flags(args, training), args


def main(argv: list[str] | None = None) -> dict:
    config, train_cfg, args = parse_args(argv)
    params = None
    if args.load:
        loaded_config, params = lm.load_checkpoint(args.load)
        config = dataclasses.replace(loaded_config, batch=config.batch, seq=config.seq)
    corpus = stdlib_text.load_corpus()
    print(
        f"{config}\n{train_cfg}\ntext: {corpus.train_files} training files ({len(corpus.train):,} bytes), "
        f"{corpus.held_out_files} held out ({len(corpus.held_out):,} bytes); "
        f"zlib -9 takes {stdlib_text.zlib_bits_per_byte(corpus.held_out):.3f} bits per held-out byte"
    )
    print(f"attention {args.attention} on {jax.devices()[0].device_kind}")
    runs = [train(config, train_cfg, corpus, attention=args.attention, seed=args.seed, params=params)]
    if args.compare:
        runs.append(train(config, train_cfg, corpus, attention=args.compare, seed=args.seed, params=params))
    for run in runs:
        print(
            f"[{run['attention']}] held-out loss {run['held_out_loss']:.4f} nats/byte, "
            f"{run['held_out_bits_per_byte']:.4f} bits/byte; {run['tokens_per_second']:,.0f} tokens/s"
        )
    result = {"config": config, "train": train_cfg, "runs": runs}
    if args.compare:
        result["max_loss_difference"] = print_comparison(*runs, train_cfg.log_every)
    if args.save:
        lm.save_checkpoint(args.save, config, runs[0]["params"])
        print(f"saved the {args.attention} model's parameters to {args.save}")
    return result


if __name__ == "__main__":
    main()
