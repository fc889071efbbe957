"""chordq: quantize Kimi K2.x routed experts to compressed-tensors INT4 group 32 for Chord / vLLM."""

__version__ = "0.1.0"

from .convert import ConvertOptions, ConvertResult, convert_checkpoint  # noqa: E402
from .errors import ChordqError, InputError, OutputError  # noqa: E402
from .quant import Method  # noqa: E402

__all__ = [
    "__version__",
    "convert_checkpoint",
    "ConvertOptions",
    "ConvertResult",
    "Method",
    "ChordqError",
    "InputError",
    "OutputError",
]
