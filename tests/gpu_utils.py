"""Skipping GPU tests cleanly where there is no Hopper GPU with the jzyfa extension.

Use either `@requires_hopper` on a test or class, or `pytestmark = pytest.mark.gpu` in a module
(conftest skips `gpu`-marked tests with the same reason).
"""

import pytest

import jzyfa

# None where the kernel can run; else why not (no GPU, not Hopper, extension missing).
HOPPER_SKIP_REASON: str | None = jzyfa.kernel_unavailable_reason()

requires_hopper = pytest.mark.skipif(
    HOPPER_SKIP_REASON is not None, reason=f"needs a Hopper GPU and the jzyfa extension: {HOPPER_SKIP_REASON}"
)


def assert_bitwise_reruns(fn, args, reruns: int) -> None:
    """fn(*args) gives bitwise the same results `reruns` times, with other GPU work (a matmul chain)
    queued between the calls: the kernels' outputs must not depend on scheduling."""
    import jax.numpy as jnp
    import numpy as np

    first = [np.asarray(x).view(np.uint8) for x in fn(*args)]
    noise = jnp.ones((4096, 4096))
    for _ in range(reruns):
        again = fn(*args)
        noise = noise @ noise * 1e-4  # other GPU work in between
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, np.asarray(b).view(np.uint8))
