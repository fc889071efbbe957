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

Chord in-memory layouts (format.md §4)
--------------------------------------
chordq never writes these; Chord builds them on the GPU at load time from the checkpoint
tensors above. They are reproduced here, in plain PyTorch on CPU, so that a GPU packer (Chord's
``pack_w4a16`` / ``pack_w4a16_grouped``, Humming's ``transform_humming_weight``) can be checked
bit for bit. Inputs are the checkpoint tensors of ``E`` experts: ``words`` int32 ``[E, N, K/8]``
and ``scale`` BF16 ``[E, N, K/32]`` (2-D ``[N, K/8]`` / ``[N, K/32]`` is taken as ``E = 1`` and
the result comes back without the expert dim). ``code[e, n, k]`` is the unsigned nibble of
§2.1; every layout below stores that code unchanged (the kernels subtract 8), only moved.
Each forward map has an exact inverse (``*_inverse``) that restores the checkpoint tensor.

Indexed weight, ``chord_indexed_weight(words, layout)`` (§4.2): int32 ``[E, K/16, 2N]``.
Requires ``N % 128 == 0`` and ``K % 64 == 0``. Nibble ``p`` (bits ``4p..4p+3``) of word
``[e, r, c]`` holds ``code[e, n, k]`` with::

    lane = (c % 128) // 4 ;  t = c % 4 ;  nb = c // 128
    s  = (p % 4) * 2 + p // 4        # nibbles 0..3 <- slots 0, 2, 4, 6; nibbles 4..7 <- 1, 3, 5, 7
    a  = s // 4 ;  b = (s // 2) % 2 ;  kk = s % 2
    (i4, i5) = (a, b) for "mma",  (b, a) for "wgmma"   # wgmma = "mini-block transpose"
    n = 64 * nb + 16 * t + 8 * i4 + lane // 4
    k = 16 * r + 8 * i5 + 2 * (lane % 4) + kk

So each 128-word run of a row ``r`` covers the 64 x 16 tile ``n in [64 nb, 64 nb + 64)``,
``k in [16 r, 16 r + 16)``. ``"mma"`` is the decode (swap-AB) layout and equals upstream
Humming's uint4 x bf16 layout; ``"wgmma"`` is the prefill layout. They are not interchangeable.

Indexed scale, ``chord_indexed_scale(scale)`` (§4.3): ``[E, K/32, N]``, i.e. the transpose
followed, inside every run of 64 consecutive N positions, by an 8 x 8 transpose::

    out[e, g, 64 m + j] = scale[e, 64 m + (j % 8) * 8 + j // 8, g]      (j in 0..63)

Requires ``N % 128 == 0`` (Chord's contract; the permutation itself needs only 64). The 8 x 8
transpose is its own inverse.

Grouped weight, ``chord_grouped_weight(words, mode)`` (§4.4, SM90 DeepGEMM-style):
``torch.uint8 [E, N, K/2]``. Chord stores these same bytes in a tensor *viewed* as
``torch.float8_e4m3fn`` (a byte container only; the inverse accepts either dtype).
``mode="contiguous"`` (prefill) uses ``BLOCK_K = 64``, ``mode="masked"`` (decode)
``BLOCK_K = 128``; requires ``N % 64 == 0`` and ``K % BLOCK_K == 0``. The weight is cut into
atoms of 64 rows x BLOCK_K codes, ``(n, k) = (64 i + nl, BLOCK_K j + kl)``; inside an atom the
local bits ``nl = (n0..n5)``, ``kl = (k0..k6)`` (LSB first; ``k6`` only for BLOCK_K 128) are
permuted to::

    destination row    = 64 i + bits(n0, n1, n2, k4, n4, n5)
    destination column = BLOCK_K j + bits(n3, k3, k0, k1, k2, k5, k6)   # a nibble position

and columns are packed two per byte, even column in the low nibble:
``byte[e, row, b] = col[2b] | col[2b + 1] << 4``. Because ``k6`` lands on column bit 6 and
nowhere else, BK64 and BK128 give identical bytes whenever ``K % 128 == 0``.

chordq's fragment order, ``fragment_order(words)`` (the Triton kernels' ``k_order="fragments"``):
int32, same shape ``[..., K/8]`` as the checkpoint words; scales unchanged. Codes move only
inside their own group of 32 (so word ``w`` still belongs to group ``w // 4``): nibble
``j + 4 h`` of word ``4 g + t`` holds checkpoint ``k = 32 g + 16 (j // 2) + 8 (j % 2) + 2 t + h``
(``t, j in 0..3``, ``h in 0..1``). Nibbles ``j`` and ``j + 4`` are then ``k`` and ``k + 1``, and
the 8 codes of one word are exactly what one thread holds of a BF16 tensor-core A fragment
(k16 columns ``2t, 2t+1, 2t+8, 2t+9`` of two consecutive k16 chunks), so a word dequantizes
in place into the registers the MMA reads. Requires ``K % 32 == 0``.

chordq's subnormal scales, ``subnormal_scales(scale)`` (the Triton kernels'
``k_order="subnormal"``, read with fragment-order words): BF16, same shape, every scale times
``2**129`` (exact: a power of two). A BF16 whose bits are below ``0x100`` is worth
``bits * 2**-133``, so the kernel masks a code into bits 4-7 of each BF16 half (``code *
2**-129``) and one fma with the stored scale and ``-8 s`` gives ``bf16((code - 8) * s)``, the
reference's value, in 12 instructions per word instead of 15. Scales must satisfy ``|s| <
0.498`` (larger ones would overflow BF16).

chordq's row blocks, ``row_blocks(t)`` (the Triton and Gluon kernels' ``w_order="blocked"``:
fragment-order words and subnormal scales, each in row blocks): any ``[E, N, C]`` tensor of
words (``C = K/8``) or scales (``C = K/32``) in the memory order ``[E, N/128, K/256, 128,
C/(K/256)]``, same shape and dtype: the 128 rows of one 256-deep K step (128 B of words or 16 B
of scales each) are one contiguous piece (16 KB of words), where the checkpoint order puts
them K/2 bytes apart. A decode tile's step is then one DRAM stream, not 128 (H200: 0.91-0.95
of the time of the same tile on the unblocked words, docs/kernel_notes.md variant 46).
Requires ``N % 128 == 0`` and ``K % 256 == 0``; with ``K = 256`` it is the identity.

Grouped scale, ``chord_grouped_scale(scale)``: the plain transpose ``[E, K/32, N]`` (N
contiguous), no 8 x 8 permutation. Requires ``N % 64 == 0``.
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
    "CHORD_INDEXED_LAYOUTS",
    "CHORD_GROUPED_BLOCK_K",
    "chord_indexed_weight",
    "chord_indexed_weight_inverse",
    "chord_indexed_scale",
    "chord_indexed_scale_inverse",
    "chord_grouped_weight",
    "chord_grouped_weight_inverse",
    "chord_grouped_scale",
    "chord_grouped_scale_inverse",
    "fragment_order",
    "fragment_order_inverse",
    "SUBNORMAL_SCALE_EXP",
    "subnormal_scales",
    "subnormal_scales_inverse",
    "ROW_BLOCK",
    "K_BLOCK",
    "row_blocks",
    "row_blocks_inverse",
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


# ----------------------------------------------------------------------------------------------
# Chord in-memory layouts (format.md §4). Each forward map builds, from the closed-form formula,
# the checkpoint position (n, k) of every destination nibble and gathers codes; each inverse
# scatters them back. The formulas live in the small ``_*_source`` helpers below.
# ----------------------------------------------------------------------------------------------

CHORD_INDEXED_LAYOUTS = ("mma", "wgmma")
CHORD_GROUPED_BLOCK_K = {"contiguous": 64, "masked": 128}


def _indexed_source(
    r: torch.Tensor, c: torch.Tensor, p: torch.Tensor, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.2: checkpoint ``(n, k)`` of nibble ``p`` of indexed word ``[r, c]`` (broadcasts)."""
    lane, t, nb = (c % 128) // 4, c % 4, c // 128
    s = (p % 4) * 2 + p // 4
    a, b, kk = s // 4, (s // 2) % 2, s % 2
    i4, i5 = (a, b) if layout == "mma" else (b, a)
    n = 64 * nb + 16 * t + 8 * i4 + lane // 4
    k = 16 * r + 8 * i5 + 2 * (lane % 4) + kk
    return n, k


def _indexed_scale_source(j: torch.Tensor) -> torch.Tensor:
    """§4.3: N position read by output position ``j`` (8 x 8 transpose inside each 64-run)."""
    return 64 * (j // 64) + (j % 8) * 8 + (j % 64) // 8


def _grouped_atom_source(
    rl: torch.Tensor, cl: torch.Tensor, block_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.4: atom-local source ``(nl, kl)`` of destination ``(row, nibble column)`` inside one
    64 x ``block_k`` atom (broadcasts). Inverts ``row = bits(n0, n1, n2, k4, n4, n5)``,
    ``col = bits(n3, k3, k0, k1, k2, k5, k6)`` (LSB first)."""

    def bit(x: torch.Tensor, i: int) -> torch.Tensor:
        return (x >> i) & 1

    nl = bit(rl, 0) | bit(rl, 1) << 1 | bit(rl, 2) << 2 | bit(cl, 0) << 3 | bit(rl, 4) << 4
    nl = nl | bit(rl, 5) << 5
    kl = bit(cl, 2) | bit(cl, 3) << 1 | bit(cl, 4) << 2 | bit(cl, 1) << 3 | bit(rl, 3) << 4
    kl = kl | bit(cl, 5) << 5
    if block_k == 128:
        kl = kl | bit(cl, 6) << 6
    return nl, kl


def _indexed_flat_source(n: int, k: int, layout: str) -> torch.Tensor:
    """int64 ``[K/16, 2N, 8]``: flat checkpoint position ``n * K + k`` of every nibble."""
    r = torch.arange(k // 16, dtype=torch.int64).view(-1, 1, 1)
    c = torch.arange(2 * n, dtype=torch.int64).view(1, -1, 1)
    p = torch.arange(PACK_FACTOR, dtype=torch.int64).view(1, 1, -1)
    # n_src depends on (c, p) only and k_src = 16 r + f(c, p); evaluating at r = 0 and adding
    # the row offset last keeps every intermediate small except the one final broadcast add.
    src_n, src_k0 = _indexed_source(torch.zeros_like(r[:1]), c, p, layout)
    return (src_n * k + src_k0) + 16 * r


def _grouped_flat_source(n: int, k: int, block_k: int) -> torch.Tensor:
    """int64 ``[N, K]``: flat checkpoint position ``n * K + k`` of every destination nibble."""
    rl = torch.arange(64, dtype=torch.int64).view(-1, 1)
    cl = torch.arange(block_k, dtype=torch.int64).view(1, -1)
    nl, kl = _grouped_atom_source(rl, cl, block_k)
    local = (nl * k + kl).view(1, 64, 1, block_k)  # within atom (i, j) = (row // 64, col // BK)
    i = torch.arange(n // 64, dtype=torch.int64).view(-1, 1, 1, 1)
    j = torch.arange(k // block_k, dtype=torch.int64).view(1, 1, -1, 1)
    return ((64 * k) * i + block_k * j + local).view(n, k)


def _experts(t: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
    """``[N, X]`` -> ``([1, N, X], True)``; ``[E, N, X]`` -> ``(t, False)``."""
    if t.ndim == 2:
        return t.unsqueeze(0), True
    if t.ndim == 3:
        return t, False
    raise ValueError(f"{name}: expected a 2-D [N, X] or 3-D [E, N, X] tensor, got shape "
                     f"{tuple(t.shape)}")


def _check_words(words: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
    if words.dtype != torch.int32:
        raise ValueError(f"{name}: expected checkpoint words int32 [E, N, K/8], got {words.dtype}")
    return _experts(words, name)


def _check_layout(layout: str) -> None:
    if layout not in CHORD_INDEXED_LAYOUTS:
        raise ValueError(f"layout must be one of {CHORD_INDEXED_LAYOUTS}, got {layout!r}")


def _check_indexed_nk(n: int, k: int, name: str) -> None:
    if n % 128 or k % 64:
        raise ValueError(f"{name}: Chord's indexed layout needs N % 128 == 0 and K % 64 == 0, "
                         f"got N={n}, K={k}; pad N and K first (vLLM pads N to 256, K to 128)")


def _block_k(mode: str, n: int, k: int, name: str) -> int:
    if mode not in CHORD_GROUPED_BLOCK_K:
        raise ValueError(f"mode must be one of {tuple(CHORD_GROUPED_BLOCK_K)}, got {mode!r}")
    block_k = CHORD_GROUPED_BLOCK_K[mode]
    if n % 64 or k % block_k:
        raise ValueError(f"{name}: Chord's grouped {mode!r} layout needs N % 64 == 0 and "
                         f"K % {block_k} == 0, got N={n}, K={k}")
    return block_k


def chord_indexed_weight(words: torch.Tensor, layout: str = "mma") -> torch.Tensor:
    """Checkpoint words -> Chord's indexed physical weight (format.md §4.2).

    The CPU twin of Chord's ``pack_w4a16(weight, scale, layout, packed=True)`` weight output;
    the formula is in the module docstring ("Indexed weight").

    :param words: int32 ``[E, N, K/8]`` (or ``[N, K/8]``), §2.1 bits; ``N % 128 == 0``,
        ``K % 64 == 0``
    :param layout: ``"mma"`` (decode, swap-AB; = upstream Humming) or ``"wgmma"`` (prefill)
    :returns: int32 ``[E, K/16, 2N]`` (or ``[K/16, 2N]``)
    :raises ValueError: wrong dtype/rank, unknown layout, or N, K not divisible
    """
    _check_layout(layout)
    w, squeeze = _check_words(words, "chord_indexed_weight")
    e, n, k = w.shape[0], w.shape[1], w.shape[2] * PACK_FACTOR
    _check_indexed_nk(n, k, "chord_indexed_weight")
    src = _indexed_flat_source(n, k, layout).to(w.device).view(-1)
    out = torch.empty(e, k // 16, 2 * n, dtype=torch.int32, device=w.device)
    for i in range(e):  # one expert at a time bounds memory (an index of N*K int64 is shared)
        codes = unpack_codes(w[i]).view(-1).index_select(0, src)
        out[i] = pack_codes(codes.view(k // 16, 2 * n * PACK_FACTOR))
    return out.squeeze(0) if squeeze else out


def chord_indexed_weight_inverse(packed: torch.Tensor, layout: str = "mma") -> torch.Tensor:
    """Chord's indexed physical weight -> checkpoint words; exact inverse of
    :func:`chord_indexed_weight`.

    :param packed: int32 ``[E, K/16, 2N]`` (or ``[K/16, 2N]``)
    :param layout: the layout it was packed with, ``"mma"`` or ``"wgmma"``
    :returns: int32 ``[E, N, K/8]`` (or ``[N, K/8]``)
    """
    _check_layout(layout)
    p, squeeze = _check_words(packed, "chord_indexed_weight_inverse")
    if p.shape[2] % 2:
        raise ValueError(f"chord_indexed_weight_inverse: last dim 2N must be even, "
                         f"got {p.shape[2]}")
    e, k, n = p.shape[0], p.shape[1] * 16, p.shape[2] // 2
    _check_indexed_nk(n, k, "chord_indexed_weight_inverse")
    src = _indexed_flat_source(n, k, layout).to(p.device).view(-1)
    out = torch.empty(e, n, k // PACK_FACTOR, dtype=torch.int32, device=p.device)
    codes = torch.empty(n * k, dtype=torch.uint8, device=p.device)
    for i in range(e):
        codes.index_copy_(0, src, unpack_codes(p[i]).view(-1))
        out[i] = pack_codes(codes.view(n, k))
    return out.squeeze(0) if squeeze else out


def _check_scale_n(n: int, multiple: int, name: str) -> None:
    if n % multiple:
        raise ValueError(f"{name}: needs N % {multiple} == 0, got N={n}")


def chord_indexed_scale(scale: torch.Tensor) -> torch.Tensor:
    """Checkpoint scale -> Chord's indexed scale (format.md §4.3; = Humming's
    ``transform_humming_weight_scale``).

    ``out[e, g, 64 m + j] = scale[e, 64 m + (j % 8) * 8 + j // 8, g]``. Any dtype is moved
    bitwise (Chord uses BF16).

    :param scale: ``[E, N, K/32]`` (or ``[N, K/32]``), ``N % 128 == 0``
    :returns: contiguous ``[E, K/32, N]`` (or ``[K/32, N]``)
    """
    s, squeeze = _experts(scale, "chord_indexed_scale")
    _check_scale_n(s.shape[1], 128, "chord_indexed_scale")
    src = _indexed_scale_source(torch.arange(s.shape[1], device=s.device))
    out = s.transpose(1, 2).index_select(2, src).contiguous()
    return out.squeeze(0) if squeeze else out


def chord_indexed_scale_inverse(packed_scale: torch.Tensor) -> torch.Tensor:
    """Chord's indexed scale ``[E, K/32, N]`` -> checkpoint scale ``[E, N, K/32]``; exact
    inverse of :func:`chord_indexed_scale` (2-D in, 2-D out)."""
    s, squeeze = _experts(packed_scale, "chord_indexed_scale_inverse")
    _check_scale_n(s.shape[2], 128, "chord_indexed_scale_inverse")
    src = _indexed_scale_source(torch.arange(s.shape[2], device=s.device))
    t = torch.empty_like(s).index_copy_(2, src, s)
    out = t.transpose(1, 2).contiguous()
    return out.squeeze(0) if squeeze else out


def chord_grouped_weight(words: torch.Tensor, mode: str = "contiguous") -> torch.Tensor:
    """Checkpoint words -> Chord's grouped (DeepGEMM-style, SM90) weight bytes (format.md §4.4).

    The CPU twin of Chord's ``pack_w4a16_grouped(weight, scale, mode)`` weight output; the
    atom bit permutation is in the module docstring ("Grouped weight"). Chord views the result
    as ``torch.float8_e4m3fn`` (``out.view(torch.float8_e4m3fn)``); the bytes are the same.

    :param words: int32 ``[E, N, K/8]`` (or ``[N, K/8]``); ``N % 64 == 0``,
        ``K % BLOCK_K == 0``
    :param mode: ``"contiguous"`` (prefill, BLOCK_K 64) or ``"masked"`` (decode, BLOCK_K 128)
    :returns: ``torch.uint8`` ``[E, N, K/2]`` (or ``[N, K/2]``), two codes per byte, even
        destination column in the low nibble
    """
    w, squeeze = _check_words(words, "chord_grouped_weight")
    e, n, k = w.shape[0], w.shape[1], w.shape[2] * PACK_FACTOR
    block_k = _block_k(mode, n, k, "chord_grouped_weight")
    src = _grouped_flat_source(n, k, block_k).to(w.device).view(-1)
    out = torch.empty(e, n, k // 2, dtype=torch.uint8, device=w.device)
    for i in range(e):
        codes = unpack_codes(w[i]).view(-1).index_select(0, src).view(n, k)
        out[i] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return out.squeeze(0) if squeeze else out


def chord_grouped_weight_inverse(data: torch.Tensor, mode: str = "contiguous") -> torch.Tensor:
    """Chord's grouped weight bytes -> checkpoint words; exact inverse of
    :func:`chord_grouped_weight`.

    :param data: ``torch.uint8`` or ``torch.float8_e4m3fn`` ``[E, N, K/2]`` (or ``[N, K/2]``)
    :param mode: the mode it was packed with, ``"contiguous"`` or ``"masked"``
    :returns: int32 ``[E, N, K/8]`` (or ``[N, K/8]``)
    """
    if data.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"chord_grouped_weight_inverse: expected uint8 or float8_e4m3fn bytes, "
                         f"got {data.dtype}")
    b, squeeze = _experts(data.view(torch.uint8), "chord_grouped_weight_inverse")
    e, n, k = b.shape[0], b.shape[1], b.shape[2] * 2
    block_k = _block_k(mode, n, k, "chord_grouped_weight_inverse")
    src = _grouped_flat_source(n, k, block_k).to(b.device).view(-1)
    out = torch.empty(e, n, k // PACK_FACTOR, dtype=torch.int32, device=b.device)
    dst = torch.empty(n, k, dtype=torch.uint8, device=b.device)
    codes = torch.empty(n * k, dtype=torch.uint8, device=b.device)
    for i in range(e):
        dst[:, 0::2] = b[i] & 0xF
        dst[:, 1::2] = b[i] >> 4
        codes.index_copy_(0, src, dst.view(-1))
        out[i] = pack_codes(codes.view(n, k))
    return out.squeeze(0) if squeeze else out


def chord_grouped_scale(scale: torch.Tensor) -> torch.Tensor:
    """Checkpoint scale ``[E, N, K/32]`` -> Chord's grouped scale ``[E, K/32, N]``: a plain
    contiguous transpose, no permutation (format.md §4.4). ``N % 64 == 0``; 2-D in, 2-D out."""
    s, squeeze = _experts(scale, "chord_grouped_scale")
    _check_scale_n(s.shape[1], 64, "chord_grouped_scale")
    out = s.transpose(1, 2).contiguous()
    return out.squeeze(0) if squeeze else out


def chord_grouped_scale_inverse(packed_scale: torch.Tensor) -> torch.Tensor:
    """Chord's grouped scale ``[E, K/32, N]`` -> checkpoint scale ``[E, N, K/32]``; exact
    inverse of :func:`chord_grouped_scale` (2-D in, 2-D out)."""
    s, squeeze = _experts(packed_scale, "chord_grouped_scale_inverse")
    _check_scale_n(s.shape[2], 64, "chord_grouped_scale_inverse")
    out = s.transpose(1, 2).contiguous()
    return out.squeeze(0) if squeeze else out


def _fragment_source() -> torch.Tensor:
    """int64 ``[32]``: group-local checkpoint k of fragment nibble ``8 t + (j + 4 h)``."""
    t, h, j = torch.meshgrid(torch.arange(4), torch.arange(2), torch.arange(4), indexing="ij")
    return (16 * (j // 2) + 8 * (j % 2) + 2 * t + h).reshape(32)


def fragment_order(words: torch.Tensor) -> torch.Tensor:
    """Checkpoint words ``[..., K/8]`` -> the same codes in fragment order (docstring above)."""
    codes = _group_codes(words)
    return pack_codes(codes[..., _fragment_source().to(words.device)].flatten(-2))


def fragment_order_inverse(words: torch.Tensor) -> torch.Tensor:
    """Exact inverse of :func:`fragment_order`."""
    codes = _group_codes(words)
    inverse = torch.argsort(_fragment_source()).to(words.device)
    return pack_codes(codes[..., inverse].flatten(-2))


SUBNORMAL_SCALE_EXP = 129  # subnormal_scales stores s * 2**129


def subnormal_scales(scale: torch.Tensor) -> torch.Tensor:
    """BF16 scales -> the same scales times ``2**129`` (docstring above); ValueError naming the
    largest ``|s|`` when one is too large to scale (``|s| >= 0.498``) or not finite."""
    if scale.dtype != torch.bfloat16:
        raise ValueError(f"subnormal_scales takes BF16 scales, got {scale.dtype}")
    out = torch.ldexp(scale.double(), torch.tensor(SUBNORMAL_SCALE_EXP, dtype=torch.float64,
                                                   device=scale.device)).to(torch.bfloat16)
    if not bool(torch.isfinite(out).all()):
        worst = float(scale.float().abs().nan_to_num(float("inf")).max())
        raise ValueError(f"a scale of magnitude {worst:g} does not fit the subnormal "
                         "dequantization (|s| < 0.498): keep the scales as they are "
                         "(w_order 'fragments')")
    return out


def subnormal_scales_inverse(scale: torch.Tensor) -> torch.Tensor:
    """Exact inverse of :func:`subnormal_scales`."""
    return torch.ldexp(scale.double(), torch.tensor(-SUBNORMAL_SCALE_EXP, dtype=torch.float64,
                                                    device=scale.device)).to(torch.bfloat16)


def _group_codes(words: torch.Tensor) -> torch.Tensor:
    if words.shape[-1] % 4:
        raise ValueError(f"K={8 * words.shape[-1]} is not a multiple of 32")
    codes = unpack_codes(words)
    return codes.reshape(*codes.shape[:-1], codes.shape[-1] // 32, 32)


ROW_BLOCK = 128  # rows of one row_blocks piece
K_BLOCK = 256  # K of one row_blocks piece (32 words or 8 scales a row)


def _row_block_view(t: torch.Tensor, k: int, name: str) -> tuple[int, int, int, int]:
    if t.dim() != 3:
        raise ValueError(f"{name} takes [E, N, C] words or scales, got {tuple(t.shape)}")
    e, n, c = t.shape
    if n % ROW_BLOCK or k % K_BLOCK:
        raise ValueError(f"{name} needs N % {ROW_BLOCK} == 0 and K % {K_BLOCK} == 0, got "
                         f"N={n}, K={k}")
    return e, n // ROW_BLOCK, k // K_BLOCK, c // (k // K_BLOCK)


def row_blocks(t: torch.Tensor, k: int) -> torch.Tensor:
    """Words ``[E, N, K/8]`` or scales ``[E, N, K/32]`` of a K-deep weight -> row blocks
    (docstring above), same shape."""
    e, nb, kb, per = _row_block_view(t, k, "row_blocks")
    v = t.reshape(e, nb, ROW_BLOCK, kb, per).permute(0, 1, 3, 2, 4)
    return v.contiguous().reshape(t.shape)


def row_blocks_inverse(t: torch.Tensor, k: int) -> torch.Tensor:
    """Exact inverse of :func:`row_blocks`."""
    e, nb, kb, per = _row_block_view(t, k, "row_blocks_inverse")
    v = t.reshape(e, nb, kb, ROW_BLOCK, per).permute(0, 1, 3, 2, 4)
    return v.contiguous().reshape(t.shape)
