"""The named thresholds and sampling constants of ``chordq verify`` (style.md §8).

Every pass/fail decision in the ``verify*`` modules uses one of these; :mod:`chordq.verify`
re-exports them and writes the thresholds into every report (``thresholds()``).
"""

__all__ = [
    "CHORD_GROUP_SIZE",
    "COMPUTE_TOKENS",
    "DEFAULT_EXPERTS_PER_LAYER",
    "DIAGNOSE_MARGIN_DB",
    "INT4_MAX_COS_DIFF",
    "INTERPRETED_KERNEL_MAX_WEIGHTS",
    "KERNEL_MAX_COS_DIFF",
    "LAYOUT_SPOT_CODES",
    "MAX_FAILURES_PER_CHECK",
    "ROUTING_POOL_TOKENS",
    "RTN_TOLERANCE_DB",
    "SEED",
    "SIGNED_CODES_EDGE_RATIO",
    "SMALL_MODEL_EXPERTS",
    "SQNR_FLOOR_DB",
]

# Fidelity: a quantized expert tensor may be at most this much worse (dB) than plain RTN of the
# same source tensor. chordq's mse search is never worse than rtn group by group and rtn *is*
# rtn, so only float summation order separates them.
RTN_TOLERANCE_DB = 0.01
# Fidelity: absolute floor for any expert tensor. INT4 group-32 lands at 17-21 dB on real
# weight distributions (README table); 12 dB is a 25% relative RMS error, a broken tensor.
SQNR_FLOOR_DB = 12.0
# Compute: Triton kernel vs the PyTorch INT4 reference on the same words. Chord's grouped-path
# limit (format.md §4.1); the interpreter lands near 1e-11, an H200 near 1e-6.
KERNEL_MAX_COS_DIFF = 1e-3
# Compute: the INT4 MoE vs the float MoE on the source weights. cos_diff ~ relative error^2 / 2;
# three INT4 GEMMs at 18.5 dB measure 0.02 (relative error 0.2) on the tiny models. 0.1
# (relative error ~0.45) is a gross-error bound: the per-tensor SQNR is the fine check, and a
# broken layer (flipped nibbles, another expert's scales) lands near 1.
INT4_MAX_COS_DIFF = 0.1
# Fidelity diagnosis: a failing tensor is blamed on a packing bug (flipped nibbles, signed codes)
# when reading its words that way fits the source by at least this much better.
DIAGNOSE_MARGIN_DB = 6.0
# Codes: two's-complement nibbles put the small weights at codes 0, 1, 14, 15 and leave 7, 8, 9
# nearly empty. Offset binary is the reverse; a uniform code distribution gives a ratio of 1.
# A tensor whose per-bin mass at {0, 1, 14, 15} exceeds this multiple of that at {7, 8, 9}
# holds signed codes.
SIGNED_CODES_EDGE_RATIO = 4.0
# Chord and Humming run group 32 only (format.md §3.5).
CHORD_GROUP_SIZE = 32

# Sampling for the compute check (deterministic: seeded by layer).
SMALL_MODEL_EXPERTS = 64  # layers with at most this many routed experts are computed in full
DEFAULT_EXPERTS_PER_LAYER = 8
COMPUTE_TOKENS = 32  # tokens per layer run through the MoE
ROUTING_POOL_TOKENS = 4096  # candidates routed to find tokens that reach the sampled experts
SEED = 0
# On CPU the Triton kernel runs in Triton's interpreter (~15 s per Kimi-size expert): per layer
# it runs on the first sampled experts holding at most this many INT4 weights (at least one).
INTERPRETED_KERNEL_MAX_WEIGHTS = 1 << 24
LAYOUT_SPOT_CODES = 4096  # codes per expert and layout decoded through the closed form of §4.2
# Failures kept per check in the report (the counts are always complete).
MAX_FAILURES_PER_CHECK = 50
