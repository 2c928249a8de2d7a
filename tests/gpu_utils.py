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
