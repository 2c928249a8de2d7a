"""The byte-level causal LM that examples/train.py trains, and its checkpoint files.

The model is examples/prefill.py's transformer (RMSNorm, RoPE, GQA attention, gated MLP) with a
vocabulary of the 256 byte values. Parameters are kept in float32 (the optimizer's master copy) and
cast to bf16 for every forward, so activations and matmuls run in bf16.

What other tools import:

    config, params = lm.load_checkpoint("lm.npz")
    logits = lm.apply(config, params, tokens, attention="jzyfa")    # tokens: int [batch, seq] bytes

A checkpoint is one `.npz` file: every parameter as a float32 array named by its path in the parameter
tree (`params/layers/wq`, stacked over layers on the leading axis) and `config`, the model's
`prefill.Config` as JSON. No pickled code: `numpy.load(..., allow_pickle=False)` reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jzyfa

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # the model of examples/prefill.py
import prefill

VOCAB = 256  # bytes
ATTENTIONS = ("jzyfa", "cudnn", "xla")


def attention_fn(name: str) -> prefill.AttentionFn:
    """Causal attention by name: jzyfa's (its kernel where it serves, else its pure-JAX path),
    cuDNN's or XLA's through `jax.nn.dot_product_attention`."""
    if name == "jzyfa":
        return functools.partial(jzyfa.flash_attention, causal=True)
    if name in ("cudnn", "xla"):
        return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=name)
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {name!r}")


def init_params(config: prefill.Config, key: jax.Array) -> dict:
    """float32 master weights, drawn as prefill.init_params draws them."""
    return jax.tree.map(lambda w: w.astype(jnp.float32), prefill.init_params(config, key))


def apply(config: prefill.Config, params: dict, tokens: jax.Array, attention: str = "jzyfa") -> jax.Array:
    """Bytes [batch, seq] -> float32 next-byte logits [batch, seq, 256], computed in bf16."""
    bf16_params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    return prefill.forward(bf16_params, tokens, config, attention_fn(attention))


def next_byte_loss(config: prefill.Config, params: dict, windows: jax.Array, attention: str) -> jax.Array:
    """Mean cross-entropy (nats per byte) of predicting windows[:, 1:] from windows[:, :-1]."""
    windows = windows.astype(jnp.int32)
    logits = apply(config, params, windows[:, :-1], attention)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, windows[:, 1:, None], axis=-1))


def _flatten(tree: dict, prefix: str) -> dict[str, np.ndarray]:
    flat = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{name}/"))
        else:
            flat[f"{prefix}{name}"] = np.asarray(value, np.float32)
    return flat


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = jnp.asarray(value)
    return tree


def save_checkpoint(path: str | pathlib.Path, config: prefill.Config, params: dict) -> None:
    arrays = _flatten(params, "params/")
    with open(path, "wb") as file:  # a file object, so numpy does not append ".npz" to the name
        np.savez(file, config=np.array(json.dumps(dataclasses.asdict(config))), **arrays)


def load_checkpoint(path: str | pathlib.Path) -> tuple[prefill.Config, dict]:
    """(model config, float32 parameters) of a file that save_checkpoint wrote."""
    with np.load(path, allow_pickle=False) as archive:
        config = prefill.Config(**json.loads(str(archive["config"])))
        params = _unflatten(
            {name.removeprefix("params/"): archive[name] for name in archive.files if name != "config"}
        )
    return config, params
