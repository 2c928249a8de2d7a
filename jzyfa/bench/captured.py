"""Captured q/k/v: the `.npz` format examples/capture.py writes, and its reading for the benchmark.

One `.npz`: `layer{i}_q`, `layer{i}_k`, `layer{i}_v` as uint16 bit patterns of bf16 (numpy has no
bf16 of its own; `load_captured` views them back), and `header`, JSON with the layer count, seq,
dtype, each array's shape, and the model's config. q is [batch, seq, heads_q, head_dim], k and v
[batch, seq, heads_kv, head_dim]. `python -m jzyfa.bench --inputs captured:PATH` times one layer
(`--captured_layer`); `python -m jzyfa.bench.accuracy --inputs captured:PATH` checks every layer, or
the one `--captured_layer` names.
"""

from __future__ import annotations

import json
import os
import pathlib
import zipfile
from typing import Any

import jax.numpy as jnp
import numpy as np

PREFIX = "captured:"
HOW_TO_WRITE = "write one with `python examples/capture.py --checkpoint LM.npz --out PATH`"


class CapturedFormatError(ValueError):
    """The file is missing or not a capture written by examples/capture.py."""


def is_captured(kind: str) -> bool:
    """Whether an --inputs kind is captured:PATH."""
    return kind.startswith(PREFIX)


def path_of(kind: str) -> str:
    """PATH of the --inputs kind "captured:PATH"."""
    path = kind[len(PREFIX) :]
    if not path:
        raise CapturedFormatError(f"--inputs {kind!r}: give the capture's path, e.g. captured:/tmp/qkv.npz")
    return path


def label(path: str | pathlib.Path, layer: int) -> str:
    """One layer's name in the reports' rows: captured:<file name> layer N."""
    return f"{PREFIX}{os.path.basename(path)} layer {layer}"


def shape_of(q: np.ndarray, k: np.ndarray) -> dict[str, int]:
    """batch, seq_q, seq_k, heads_q, heads_kv, head_dim of one layer's q and k."""
    batch, seq_q, heads_q, head_dim = q.shape
    _, seq_k, heads_kv, _ = k.shape
    return {
        "batch": batch,
        "seq_q": seq_q,
        "seq_k": seq_k,
        "heads_q": heads_q,
        "heads_kv": heads_kv,
        "head_dim": head_dim,
    }


def check_layer(header: dict, path: str | pathlib.Path, layer: int) -> None:
    layers = header["layers"]
    if not 0 <= layer < layers:
        raise CapturedFormatError(
            f"--captured_layer {layer} is out of range: {str(path)!r} holds layers 0 to {layers - 1}"
        )


def layers_of(path: str | pathlib.Path, layer: int | None, flag: str = "captured file") -> list[int]:
    """[layer] (checked against the file), or every layer of the file for None or -1."""
    header = read_header(path, flag)
    if layer is None or layer == -1:
        return list(range(header["layers"]))
    check_layer(header, path, layer)
    return [layer]


def save_captured(path: str | pathlib.Path, captured: list, config: dict[str, Any] | None = None) -> None:
    """Writes [(q, k, v) of layer 0, ...] (any array type, stored as bf16) and the model's config."""
    arrays, shapes = {}, {}
    for index, qkv in enumerate(captured):
        for name, array in zip("qkv", qkv):
            key = f"layer{index}_{name}"
            arrays[key] = np.asarray(jnp.asarray(array, jnp.bfloat16)).view(np.uint16)
            shapes[key] = list(arrays[key].shape)
    header = {
        "layers": len(captured),
        "seq": int(captured[0][0].shape[1]),
        "dtype": "bfloat16",
        "shapes": shapes,
        "config": config or {},
    }
    with open(path, "wb") as file:  # a file object, so numpy does not append ".npz" to the name
        np.savez(file, header=np.array(json.dumps(header)), **arrays)


def _open(path: str | pathlib.Path, flag: str):
    path = pathlib.Path(path)
    if not path.is_file():
        raise CapturedFormatError(f"{flag}: no file {str(path)!r}; {HOW_TO_WRITE}")
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise CapturedFormatError(
            f"{flag}: {str(path)!r} is not an .npz capture ({e}); {HOW_TO_WRITE}"
        ) from e
    if not isinstance(archive, np.lib.npyio.NpzFile) or "header" not in archive.files:
        raise CapturedFormatError(f"{flag}: {str(path)!r} has no capture header; {HOW_TO_WRITE}")
    return archive


def read_header(path: str | pathlib.Path, flag: str = "captured file") -> dict:
    with _open(path, flag) as archive:
        try:
            header = json.loads(str(archive["header"]))
        except json.JSONDecodeError as e:
            raise CapturedFormatError(
                f"{flag}: {str(path)!r}: header is not JSON ({e}); {HOW_TO_WRITE}"
            ) from e
    if not isinstance(header, dict) or not isinstance(header.get("layers"), int):
        raise CapturedFormatError(f"{flag}: {str(path)!r}: header has no layer count; {HOW_TO_WRITE}")
    return header


def load_layer(path: str | pathlib.Path, layer: int, flag: str = "captured file") -> tuple[np.ndarray, ...]:
    """(q, k, v) of one layer as numpy bf16 arrays; errors name `flag` and `--captured_layer`."""
    check_layer(read_header(path, flag), path, layer)
    with _open(path, flag) as archive:
        missing = [f"layer{layer}_{n}" for n in "qkv" if f"layer{layer}_{n}" not in archive.files]
        if missing:
            raise CapturedFormatError(f"{flag}: {str(path)!r} lacks {missing}; {HOW_TO_WRITE}")
        arrays = tuple(archive[f"layer{layer}_{n}"] for n in "qkv")
    q, k, v = arrays
    if (
        any(a.dtype != np.uint16 or a.ndim != 4 for a in arrays)
        or k.shape != v.shape
        or q.shape[0] != k.shape[0]
    ):
        raise CapturedFormatError(
            f"{flag}: {str(path)!r} layer {layer}: expected uint16 (bf16 bits) q [B, S, Hq, D], k and v "
            f"[B, Sk, Hkv, D]; got {[(a.dtype.name, a.shape) for a in arrays]}; {HOW_TO_WRITE}"
        )
    if q.shape[2] % k.shape[2] or q.shape[3] != k.shape[3]:
        raise CapturedFormatError(
            f"{flag}: {str(path)!r} layer {layer}: q {q.shape} and k {k.shape} do not fit (heads_q a "
            f"multiple of heads_kv, one head dim)"
        )
    return tuple(a.view(jnp.bfloat16) for a in arrays)


def load_captured(
    path: str | pathlib.Path, flag: str = "captured file"
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """[(q, k, v) of layer 0, ...] as numpy bf16 arrays [batch, seq, heads, head_dim]."""
    return [load_layer(path, index, flag) for index in range(read_header(path, flag)["layers"])]
