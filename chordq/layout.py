"""Packing only: INT4 codes <-> the int32 words chordq writes (and Chord / vLLM read).

The checkpoint layout (compressed-tensors ``pack-quantized``, format.md §2.1)
-------------------------------------------------------------------------------
For a logical weight ``W [N, K]`` (``K % 8 == 0``) quantized to ``q in [-8, 7]`` per group of 32:

``weight_packed``  int32 ``[N, K/8]``. ``code = q + 8`` (offset binary, 0..15, *not* two's
                   complement). Eight codes per word along K, lowest nibble first::

                       word[n, w] = sum_{j=0..7} code[n, 8*w + j] << (4*j)

                   i.e. bits[3:0] hold k = 8w, bits[31:28] hold k = 8w + 7. As little-endian
                   bytes, byte b of the word holds k = 8w + 2b in its low nibble and
                   k = 8w + 2b + 1 in its high nibble. Words whose top nibble is >= 8 are
                   negative as int32; that is expected.
``weight_scale``   BF16 ``[N, K/32]``; group ``g = k // 32``.
``weight_shape``   int64 ``[2]`` = ``[N, K]``.

Stacks ``[..., N, K]`` (e.g. ``[E, N, K]``) pack the last dim the same way.
Dequantization is ``(code - 8) * scale[n, k // 32]``.
"""

from __future__ import annotations

import torch

__all__ = [
    "PACK_FACTOR",
    "pack_int4",
    "unpack_int4",
    "pack_codes",
    "unpack_codes",
    "expert_tensors",
]

PACK_FACTOR = 8  # int4 codes per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned codes 0..15 (any int dtype) ``[..., K]`` -> int32 words ``[..., K/8]``."""
    if codes.shape[-1] % PACK_FACTOR:
        raise ValueError(f"K={codes.shape[-1]} is not divisible by {PACK_FACTOR}")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // PACK_FACTOR, PACK_FACTOR)
    # Nibbles are disjoint, so a sum of shifted codes is the bitwise OR; int32 wraps like uint32.
    return (c << _SHIFTS.to(c.device)).sum(dim=-1, dtype=torch.int32)


def unpack_codes(words: torch.Tensor) -> torch.Tensor:
    """int32 words ``[..., K/8]`` -> unsigned codes 0..15 as uint8 ``[..., K]``."""
    if words.dtype != torch.int32:
        raise ValueError(f"expected int32 words, got {words.dtype}")
    c = (words.unsqueeze(-1) >> _SHIFTS.to(words.device)) & 0xF  # arithmetic shift, then mask
    return c.to(torch.uint8).reshape(*words.shape[:-1], words.shape[-1] * PACK_FACTOR)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed q in [-8, 7] ``[..., K]`` -> int32 words ``[..., K/8]`` (code = q + 8)."""
    return pack_codes(q.to(torch.int32) + 8)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 words ``[..., K/8]`` -> signed q int8 in [-8, 7] ``[..., K]``."""
    return unpack_codes(words).to(torch.int8) - 8


def expert_tensors(q: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three tensors one quantized linear writes, keyed by suffix (format.md §2.2).

    :param q: int8 ``[N, K]`` in [-8, 7]
    :param scale: BF16 ``[N, K/32]``
    :returns: ``{"weight_packed": int32 [N, K/8], "weight_scale": bf16 [N, K/32],
               "weight_shape": int64 [2]}``
    """
    n, k = q.shape
    return {
        "weight_packed": pack_int4(q).contiguous(),
        "weight_scale": scale.to(torch.bfloat16).contiguous(),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
