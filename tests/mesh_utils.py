"""Test helper: meshes over the 8 CPU devices that conftest asks JAX for."""

from __future__ import annotations

import contextlib
import math

import jax
import numpy as np


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...], *, explicit: bool = False) -> jax.sharding.Mesh:
    """A mesh of the first prod(shape) CPU devices (CPU even on a GPU host), its axes Auto, or Explicit
    (what jax.make_mesh gives by default)."""
    devices = np.array(jax.devices("cpu")[: math.prod(shape)]).reshape(shape)
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.sharding.Mesh(devices, names, axis_types=(kind,) * len(names))


# How a test's mesh is made and entered: Auto axes; Explicit axes; Explicit axes inside jax.set_mesh.
MESH_KINDS = ("auto", "explicit", "explicit-set-mesh")


@contextlib.contextmanager
def mesh_of_kind(kind: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """A `cpu_mesh` of `kind` (MESH_KINDS), entered with jax.set_mesh for "explicit-set-mesh"."""
    mesh = cpu_mesh(shape, names, explicit=kind != "auto")
    with jax.set_mesh(mesh) if kind == "explicit-set-mesh" else contextlib.nullcontext():
        yield mesh
