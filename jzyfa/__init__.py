"""jzyfa: FP8 and BF16 flash attention for NVIDIA Hopper, as JAX custom calls.

Importing jzyfa never needs a GPU or the compiled extension; without them every call takes the
pure-JAX path (see `kernel_available`).
"""

from jzyfa._extension import extension_loaded, handler_calls
from jzyfa._platform import hopper_unavailable_reason as kernel_unavailable_reason
from jzyfa._platform import kernel_available
from jzyfa._version import package_version
from jzyfa.api import flash_attention, flash_attention_varlen
from jzyfa.context_parallel import context_parallel_attention
from jzyfa.dot_product_attention import dot_product_attention
from jzyfa.exporting import export_safety_checks
from jzyfa.merge import merge_attention_states
from jzyfa.quantize import dequantize, fp8_quantize, hadamard_rotate
from jzyfa.reference import attention_reference
from jzyfa.sequence_layout import balanced_positions, from_balanced_layout, to_balanced_layout

__version__ = package_version()

__all__ = [
    "__version__",
    "attention_reference",
    "balanced_positions",
    "context_parallel_attention",
    "dequantize",
    "dot_product_attention",
    "export_safety_checks",
    "extension_loaded",
    "flash_attention",
    "flash_attention_varlen",
    "fp8_quantize",
    "from_balanced_layout",
    "hadamard_rotate",
    "handler_calls",
    "kernel_available",
    "kernel_unavailable_reason",
    "merge_attention_states",
    "to_balanced_layout",
]
