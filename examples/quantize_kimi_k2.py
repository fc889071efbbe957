"""Convert a Kimi K2.x checkpoint with the library API (the CLI does the same).

    python examples/quantize_kimi_k2.py examples/tiny-kimi-k2-fp8 /tmp/tiny-kimi-w4a16
"""

import sys

from chordq import ConvertOptions, convert_checkpoint

source, output = sys.argv[1], sys.argv[2]
result = convert_checkpoint(source, output, ConvertOptions(method="mse", device="cpu"))
print(f"{result.tensors_quantized} expert tensors quantized, mean SQNR {result.sqnr_mean_db:.2f} dB -> {result.output}")
