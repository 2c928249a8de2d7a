"""What the default JAX backend can run: the Hopper kernel, its CPU stand-in, cuDNN's fused attention,
or none of them."""

from __future__ import annotations

import functools

import jax

from jzyfa import _extension, plan

HOPPER_COMPUTE_CAPABILITY = plan.HOPPER_COMPUTE_CAPABILITY


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


def _capability_key(capability: str) -> tuple[int, ...]:
    return tuple(int(part) for part in capability.split("."))


def lowest_compute_capability(devices) -> str | None:
    """The lowest CUDA compute capability of `devices` ("8.0", "9.0", ...); None when one has none (not
    a CUDA device)."""
    capabilities = [getattr(device, "compute_capability", None) for device in devices]
    if not capabilities or None in capabilities:
        return None
    return min(capabilities, key=_capability_key)


@functools.cache
def cudnn_version() -> int | None:
    """The cuDNN version JAX's fused attention would use (e.g. 90800), or None where JAX finds none
    (a CPU-only jaxlib, or no CUDA plugin)."""
    try:
        # No public accessor; jax.nn.dot_product_attention(implementation="cudnn") calls the same.
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        return int(check_cudnn_version())
    except Exception:  # noqa: BLE001 - any failure means cuDNN's attention is not available here
        return None


def target() -> plan.Target:
    """The default backend's devices as routing reads them (`jzyfa.plan.default_path`)."""
    backend = default_backend()
    kernel_problem = (
        None if kernel_available() else (hopper_unavailable_reason() or "the kernel is unavailable")
    )
    if backend != "gpu":
        return plan.Target(backend, kernel_problem)
    capability = lowest_compute_capability(jax.devices())
    return plan.Target(backend, kernel_problem, capability, cudnn_version() if capability else None)
