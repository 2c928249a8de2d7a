"""Test helper: meshes over the 8 CPU devices that conftest asks JAX for."""

from __future__ import annotations

import math

import jax
import numpy as np


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    """A mesh of the first prod(shape) CPU devices (CPU even on a GPU host)."""
    devices = np.array(jax.devices("cpu")[: math.prod(shape)]).reshape(shape)
    return jax.sharding.Mesh(devices, names)
