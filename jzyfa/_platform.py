"""What the default JAX backend can run: the Hopper kernel, its CPU stand-in, or neither."""

from __future__ import annotations

import jax

from jzyfa import _extension

HOPPER_COMPUTE_CAPABILITY = "9.0"


def default_backend() -> str:
    return jax.default_backend()


def hopper_unavailable_reason() -> str | None:
    """None when every device of the default backend is a Hopper GPU and the extension loaded.

    Otherwise a sentence saying why the kernel cannot run here, for error messages.
    """
    backend = default_backend()
    if backend != "gpu":
        return f"the default JAX backend is {backend!r}, not a CUDA GPU"
    for device in jax.devices():
        capability = getattr(device, "compute_capability", None)
        if capability != HOPPER_COMPUTE_CAPABILITY:
            return (
                f"device {device} ({device.device_kind}) has compute capability {capability}, "
                f"the kernel needs Hopper ({HOPPER_COMPUTE_CAPABILITY})"
            )
    return _extension.load_error()


def kernel_available() -> bool:
    """True when the flash-attention kernel can run on the default backend's devices."""
    return hopper_unavailable_reason() is None
