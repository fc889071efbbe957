"""The checkpoint word layout, bit for bit (format.md §2.1)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from chordq.layout import (
    expert_tensors,
    fragment_order,
    fragment_order_inverse,
    pack_codes,
    pack_int4,
    row_blocks,
    row_blocks_inverse,
    subnormal_scales,
    subnormal_scales_inverse,
    unpack_codes,
    unpack_int4,
)


def test_golden_words():
    # codes 0..15 along K: word 0 holds codes 0..7 lowest nibble first, word 1 codes 8..15.
    q = torch.arange(-8, 8, dtype=torch.int8).reshape(1, 16)
    assert pack_int4(q).tolist() == [[0x76543210, 0xFEDCBA98 - (1 << 32)]]
    # one code per word position: nibble j of word w is k = 8w + j
    codes = torch.zeros(2, 16, dtype=torch.uint8)
    codes[0, 3] = 0xA
    codes[1, 15] = 0x1
    assert pack_codes(codes).tolist() == [[0xA000, 0], [0, 0x10000000]]


def test_golden_bytes_little_endian():
    q = torch.tensor([[-8, -7, 0, 7, 1, -1, 2, -2]], dtype=torch.int8)
    raw = pack_int4(q).view(torch.uint8).tolist()[0]
    # byte b: low nibble = code of k=2b, high nibble = code of k=2b+1 (code = q + 8)
    assert raw == [0x10, 0xF8, 0x79, 0x6A]


@pytest.mark.parametrize("shape", [(1, 8), (3, 40), (7, 4096), (5, 3, 64), (2, 4, 6, 256), (830, 544)])
def test_round_trip(shape):
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    words = pack_int4(q)
    assert words.dtype == torch.int32 and words.shape == (*shape[:-1], shape[-1] // 8)
    assert torch.equal(unpack_int4(words), q)
    assert torch.equal(unpack_codes(words), (q.to(torch.int16) + 8).to(torch.uint8))


@pytest.mark.parametrize("shape", [(64, 256), (3, 17, 96), (2048, 64)])
def test_compressed_tensors_oracle(shape):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    ours = pack_int4(q)
    assert torch.equal(ours, pack_to_int32(q, 4)), "compressed-tensors packs different words"
    assert torch.equal(unpack_from_int32(ours, 4, torch.Size(shape)), q)


def test_bad_input():
    with pytest.raises(ValueError):
        pack_int4(torch.zeros(2, 12, dtype=torch.int8))
    with pytest.raises(ValueError):
        unpack_int4(torch.zeros(2, 3, dtype=torch.int64))


def test_expert_tensors():
    q = torch.randint(-8, 8, (64, 128), dtype=torch.int8)
    s = torch.rand(64, 4).to(torch.bfloat16)
    t = expert_tensors(q, s)
    assert set(t) == {"weight_packed", "weight_scale", "weight_shape"}
    assert t["weight_packed"].shape == (64, 16) and t["weight_packed"].dtype == torch.int32
    assert t["weight_scale"].dtype == torch.bfloat16 and torch.equal(t["weight_scale"], s)
    assert t["weight_shape"].tolist() == [64, 128] and t["weight_shape"].dtype == torch.int64


# ----------------------------------------------------------------------------- fragment order


def test_fragment_order_golden_words():
    # codes = k mod 16 over one row of two groups: word t of each group holds k = 2t, 2t + 8,
    # 2t + 16, 2t + 24 (nibbles 0..3) and those + 1 (nibbles 4..7)
    words = pack_codes(torch.arange(64).remainder(16).reshape(1, 64))
    got = [w & 0xFFFFFFFF for w in fragment_order(words)[0].tolist()]
    assert got == [0x91918080, 0xB3B3A2A2, 0xD5D5C4C4, 0xF7F7E6E6] * 2


def test_subnormal_scales_golden_bits_and_range():
    # times 2**129: the exponent field grows by 129, sign and mantissa bits stay; a BF16
    # subnormal scale (2**-133, bits 0x0001) becomes 2**-4, and 0.498 (0x3EFF) the largest
    # finite BF16 (0x7F7F)
    s = torch.tensor([-0.01, 2**-133, 0.0, 0.498], dtype=torch.bfloat16)
    assert [b & 0xFFFF for b in s.view(torch.int16).tolist()] == [0xBC24, 0x0001, 0, 0x3EFF]
    got = subnormal_scales(s)
    assert [b & 0xFFFF for b in got.view(torch.int16).tolist()] == [0xFCA4, 0x3D80, 0, 0x7F7F]
    assert torch.equal(subnormal_scales_inverse(got), s)
    with pytest.raises(ValueError, match="magnitude 0.5 "):
        subnormal_scales(torch.tensor([0.01, -0.5], dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="BF16"):
        subnormal_scales(s.float())


def test_row_blocks_golden_positions():
    # words [E=2, N=256, K/8=64] (K=512: two pieces a row) holding their own (e, n, w) index:
    # flat position ((e * 2 + n // 128) * 2 + w // 32) * 4096 + (n % 128) * 32 + w % 32
    e, n, c = torch.meshgrid(torch.arange(2), torch.arange(256), torch.arange(64), indexing="ij")
    words = ((e * 256 + n) * 64 + c).to(torch.int32)
    flat = row_blocks(words, 512).view(-1)
    for ei, ni, wi in ((0, 0, 0), (0, 0, 33), (0, 127, 31), (0, 128, 0), (1, 200, 40)):
        at = ((ei * 2 + ni // 128) * 2 + wi // 32) * 4096 + (ni % 128) * 32 + wi % 32
        assert int(flat[at]) == (ei * 256 + ni) * 64 + wi
    # scales [1, 128, K/32 = 16]: piece p holds groups 8p..8p+7 of all 128 rows
    scales = torch.arange(128 * 16, dtype=torch.float32).reshape(1, 128, 16).bfloat16()
    got = row_blocks(scales, 512).view(2, 128, 8)
    assert torch.equal(got[1, 5], scales[0, 5, 8:])
    assert torch.equal(row_blocks_inverse(row_blocks(words, 512), 512), words)
    # one piece a row block (K = 256): the order is unchanged
    assert torch.equal(row_blocks(words[:, :, :32].contiguous(), 256), words[:, :, :32])
    with pytest.raises(ValueError, match="N % 128 == 0 and K % 256 == 0"):
        row_blocks(words[:, :192], 512)
    with pytest.raises(ValueError, match="K=384"):
        row_blocks(words[:, :, :48], 384)


def test_fragment_order_round_trip_stays_in_group():
    codes = torch.randint(0, 16, (3, 5, 96), generator=torch.Generator().manual_seed(0))
    words = pack_codes(codes)
    frag = fragment_order(words)
    assert torch.equal(fragment_order_inverse(frag), words)
    moved = unpack_codes(frag).reshape(3, 5, 3, 32)
    before = codes.reshape(3, 5, 3, 32).to(torch.uint8)
    assert torch.equal(moved.sort(-1).values, before.sort(-1).values)
    with pytest.raises(ValueError, match="multiple of 32"):
        fragment_order(words[..., :2])
