"""A byte-level text corpus that ships with Python: the standard library's own source files.

Every `*.py` file under `sysconfig.get_paths()["stdlib"]` (installed packages in `site-packages`
left out), in sorted order, read as bytes and joined with a NUL byte between documents (NUL does not
occur in source text, so it marks a document boundary). A file belongs to the held-out split when the
CRC-32 of its path relative to the stdlib hashes into one bucket of `HELD_OUT_BUCKETS`: the split
depends only on file names, not on file order or on how many files a Python version ships.

The corpus is the same on every run with the same Python version; another version's stdlib is other
text (the loss curves of two machines agree only if their Pythons do).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig
import zlib

import numpy as np

DOCUMENT_SEPARATOR = b"\0"
HELD_OUT_BUCKETS = 20  # one bucket in 20: about 5% of the files are held out


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8 bytes of the training files, joined
    held_out: np.ndarray  # uint8 bytes of the held-out files, joined
    train_files: int
    held_out_files: int


def stdlib_sources(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The standard library's `*.py` files, sorted by their path relative to the stdlib."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = (path for path in root.rglob("*.py") if "site-packages" not in path.relative_to(root).parts)
    return sorted(
        (path for path in files if path.is_file()), key=lambda path: path.relative_to(root).as_posix()
    )


def is_held_out(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % HELD_OUT_BUCKETS == 0


def load_corpus(root: pathlib.Path | None = None) -> Corpus:
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    splits = {True: [], False: []}
    for path in stdlib_sources(root):
        splits[is_held_out(path.relative_to(root).as_posix())].append(path.read_bytes())
    joined = {held: np.frombuffer(DOCUMENT_SEPARATOR.join(texts), np.uint8) for held, texts in splits.items()}
    return Corpus(joined[False], joined[True], len(splits[False]), len(splits[True]))


def random_windows(data: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """`batch` windows of `length` consecutive bytes at random offsets: uint8 [batch, length]."""
    starts = rng.integers(0, len(data) - length + 1, size=batch)
    return data[starts[:, None] + np.arange(length)]


def evenly_spaced_windows(data: np.ndarray, count: int, length: int) -> np.ndarray:
    """`count` windows of `length` bytes spread evenly over `data` (the same whatever the seed)."""
    if count * length > len(data):
        raise ValueError(
            f"{count} windows of {length} bytes need {count * length} bytes; the data has {len(data)}"
        )
    starts = np.linspace(0, len(data) - length, count).astype(np.int64)
    return data[starts[:, None] + np.arange(length)]


def zlib_bits_per_byte(data: np.ndarray) -> float:
    """What zlib at level 9 takes per byte: a baseline a trained model must beat by a wide margin."""
    return 8 * len(zlib.compress(data.tobytes(), 9)) / len(data)
