"""Chord's in-memory layouts (format.md §4.2-§4.4), bit for bit.

Golden tests spell the closed-form formulas out again, independently of ``chordq.layout``, as
plain Python loops over a few positions; round trips check that every map is a bijection.
"""

from __future__ import annotations

import pytest
import torch

from chordq.layout import (
    chord_grouped_scale,
    chord_grouped_scale_inverse,
    chord_grouped_weight,
    chord_grouped_weight_inverse,
    chord_indexed_scale,
    chord_indexed_scale_inverse,
    chord_indexed_weight,
    chord_indexed_weight_inverse,
    pack_codes,
)

SHAPES = [(2, 256, 512), (1, 128, 64), (3, 384, 256), (2, 128, 1024)]  # (E, N, K)
REAL = (1, 4096, 7168)  # Kimi w13 under EP: N = 2I = 4096, K = H = 7168
REAL_PARAM = pytest.param(REAL, marks=pytest.mark.slow, id="real-4096x7168")


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """torch.equal on the raw bits; on failure name the first mismatching coordinate."""
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if actual.dtype.is_floating_point:
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[actual.element_size()]
        actual, expected = actual.view(bits), expected.view(bits)
    diff = actual != expected
    if diff.any():
        first = tuple(diff.nonzero()[0].tolist())
        a, e = int(actual[first]), int(expected[first])
        mask = (1 << 8 * actual.element_size()) - 1
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {diff.numel()} elements differ; first at {first}: "
            f"got 0x{a & mask:x}, expected 0x{e & mask:x}"
        )


def random_codes(e: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (e, n, k), generator=g, dtype=torch.uint8)


def random_scale(e: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, n, k // 32, generator=g).to(torch.bfloat16)


def nibble(word: int, p: int) -> int:
    return (word >> (4 * p)) & 0xF


# --- independent spellings of the formulas (format.md text, scalar Python) -----------------


def spec_indexed_source(r: int, c: int, p: int, layout: str) -> tuple[int, int]:
    lane = (c % 128) // 4
    t = c % 4
    nb = c // 128
    s = (p % 4) * 2 + p // 4
    a = s // 4
    b = (s // 2) % 2
    kk = s % 2
    i4, i5 = (a, b) if layout == "mma" else (b, a)
    n = 64 * nb + 16 * t + 8 * i4 + lane // 4
    k = 16 * r + 8 * i5 + 2 * (lane % 4) + kk
    return n, k


def spec_grouped_destination(n: int, k: int, block_k: int) -> tuple[int, int]:
    """Forward direction, as the spec states it: source (n, k) -> destination (row, column)."""
    nl, kl = n % 64, k % block_k
    nb = [(nl >> i) & 1 for i in range(6)]
    kb = [(kl >> i) & 1 for i in range(7)]
    row_bits = [nb[0], nb[1], nb[2], kb[4], nb[4], nb[5]]
    col_bits = [nb[3], kb[3], kb[0], kb[1], kb[2], kb[5], kb[6]]
    row = sum(bit << i for i, bit in enumerate(row_bits))
    col = sum(bit << i for i, bit in enumerate(col_bits))
    return n - nl + row, k - kl + col


# --- indexed weight (§4.2) ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["mma", "wgmma"])
@pytest.mark.parametrize("shape", SHAPES)
def test_indexed_weight_round_trip(shape, layout):
    e, n, k = shape
    words = pack_codes(random_codes(e, n, k, seed=n + k))
    packed = chord_indexed_weight(words, layout)
    assert packed.dtype == torch.int32 and packed.shape == (e, k // 16, 2 * n)
    assert_bitwise_equal(chord_indexed_weight_inverse(packed, layout), words, f"{layout} inverse")


@pytest.mark.parametrize("layout", ["mma", "wgmma"])
def test_indexed_weight_golden(layout):
    e, n, k = 2, 256, 128
    codes = random_codes(e, n, k, seed=7)
    packed = chord_indexed_weight(pack_codes(codes), layout)
    positions = [(0, 0, 0, 0), (0, 0, 1, 4), (1, 3, 5, 2), (1, 7, 127, 7), (0, 2, 128, 3),
                 (1, 5, 300, 6), (0, 6, 511, 1), (1, 1, 258, 5)]
    for e_, r, c, p in positions:
        n_src, k_src = spec_indexed_source(r, c, p, layout)
        got = nibble(int(packed[e_, r, c]), p)
        want = int(codes[e_, n_src, k_src])
        assert got == want, (
            f"{layout} word [{e_}, {r}, {c}] nibble {p}: got {got}, "
            f"want code[{e_}, {n_src}, {k_src}] = {want}"
        )
    # every nibble of a few whole words, with codes that encode their own position
    ramp = ((torch.arange(n).view(-1, 1) * 3 + torch.arange(k).view(1, -1)) % 16).to(torch.uint8)
    packed = chord_indexed_weight(pack_codes(ramp), layout)
    for r, c in [(0, 0), (3, 77), (7, 200), (5, 511)]:
        want = sum(int(ramp[spec_indexed_source(r, c, p, layout)]) << (4 * p) for p in range(8))
        assert int(packed[r, c]) & 0xFFFFFFFF == want, f"{layout} word [{r}, {c}]"


def test_indexed_weight_golden_first_word():
    # Word [0, 0]: lane 0, t 0 -> n = 8*i4, k = 8*i5 + kk. Nibbles 0..3 take slots 0, 2, 4, 6.
    # mma  (i4, i5) = (a, b): nibble p -> (n, k) = (0,0) (0,8) (8,0) (8,8) (0,1) (0,9) (8,1) (8,9)
    # wgmma(i4, i5) = (b, a): nibble p -> (n, k) = (0,0) (8,0) (0,8) (8,8) (0,1) (8,1) (0,9) (8,9),
    # i.e. it reads the codes the mma word holds in nibbles 0, 2, 1, 3, 4, 6, 5, 7.
    codes = torch.zeros(1, 128, 64, dtype=torch.uint8)
    for p, (n, k) in enumerate([(0, 0), (0, 8), (8, 0), (8, 8), (0, 1), (0, 9), (8, 1), (8, 9)]):
        codes[0, n, k] = p + 1
    assert int(chord_indexed_weight(pack_codes(codes), "mma")[0, 0, 0]) & 0xFFFFFFFF == 0x87654321
    assert int(chord_indexed_weight(pack_codes(codes), "wgmma")[0, 0, 0]) & 0xFFFFFFFF == 0x86754231


def test_indexed_weight_is_a_permutation():
    # the formula hits every checkpoint (n, k) exactly once
    from chordq.layout import _indexed_flat_source

    for layout in ["mma", "wgmma"]:
        src = _indexed_flat_source(256, 128, layout).view(-1)
        assert torch.equal(src.sort().values, torch.arange(256 * 128)), layout


def test_indexed_mma_and_wgmma_differ():
    words = pack_codes(random_codes(2, 256, 512, seed=3))
    mma, wgmma = chord_indexed_weight(words, "mma"), chord_indexed_weight(words, "wgmma")
    assert (mma != wgmma).float().mean() > 0.9
    # Swapping (i4, i5) keeps (lane, t, kk), so the two layouts differ only inside each word:
    # wgmma nibbles 1 <-> 2 and 5 <-> 6 swapped relative to mma.
    swap = [0, 2, 1, 3, 4, 6, 5, 7]
    nib = [(mma >> (4 * q)) & 0xF for q in range(8)]
    swapped = sum(nib[swap[p]] << (4 * p) for p in range(8)).to(torch.int32)
    assert_bitwise_equal(wgmma, swapped, "wgmma == mma with nibbles 1<->2, 5<->6 swapped")


def test_assert_bitwise_equal_names_first_mismatch():
    a = torch.zeros(2, 3, 4, dtype=torch.int32)
    b = a.clone()
    b[1, 2, 0] = -1
    b[1, 2, 3] = 5
    msg = r"2 of 24 elements differ; first at \(1, 2, 0\): got 0x0, expected 0xffffffff"
    with pytest.raises(AssertionError, match=msg):
        assert_bitwise_equal(a, b, "demo")


def test_indexed_weight_2d():
    words = pack_codes(random_codes(1, 256, 128, seed=5))
    for layout in ["mma", "wgmma"]:
        packed = chord_indexed_weight(words[0], layout)
        assert_bitwise_equal(packed, chord_indexed_weight(words, layout)[0], f"{layout} 2-D")
        back = chord_indexed_weight_inverse(packed, layout)
        assert_bitwise_equal(back, words[0], f"{layout} 2-D inverse")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["mma", "wgmma"])
def test_indexed_weight_real_size(layout):
    e, n, k = REAL
    words = pack_codes(random_codes(e, n, k, seed=11))
    packed = chord_indexed_weight(words, layout)
    assert packed.shape == (e, k // 16, 2 * n)
    for r, c, p in [(0, 0, 0), (447, 8191, 7), (200, 4097, 3)]:
        n_src, k_src = spec_indexed_source(r, c, p, layout)
        want = nibble(int(words[0, n_src, k_src // 8]), k_src % 8)
        assert nibble(int(packed[0, r, c]), p) == want, f"{layout} [{r}, {c}] nibble {p}"
    assert_bitwise_equal(chord_indexed_weight_inverse(packed, layout), words, f"{layout} real")


# --- indexed scale (§4.3) ----------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES + [REAL_PARAM])
def test_indexed_scale_round_trip(shape):
    scale = random_scale(*shape)
    packed = chord_indexed_scale(scale)
    e, n, k = shape
    assert packed.dtype == torch.bfloat16 and packed.shape == (e, k // 32, n)
    assert packed.is_contiguous()
    assert_bitwise_equal(chord_indexed_scale_inverse(packed), scale, "indexed scale inverse")


def test_indexed_scale_golden():
    scale = random_scale(2, 256, 256, seed=9)
    packed = chord_indexed_scale(scale)
    positions = [(0, 0, 0), (0, 0, 1), (0, 0, 8), (1, 3, 9), (1, 7, 63), (0, 5, 64), (1, 2, 130),
                 (0, 6, 255)]
    for e, g, pos in positions:
        m, j = divmod(pos, 64)
        src_n = 64 * m + (j % 8) * 8 + j // 8
        what = f"scale [{e}, {g}, {pos}] <- n={src_n}"
        assert_bitwise_equal(packed[e, g, pos], scale[e, src_n, g], what)
    # the first 64-run of row g reads N positions 0, 8, 16, ..., 56, 1, 9, ...
    ramp = torch.arange(128, dtype=torch.float32).to(torch.bfloat16).view(1, 128, 1)
    first = chord_indexed_scale(ramp.expand(1, 128, 2).contiguous())[0, 1, :16].float().tolist()
    assert first == [0, 8, 16, 24, 32, 40, 48, 56, 1, 9, 17, 25, 33, 41, 49, 57]


def test_indexed_scale_2d():
    scale = random_scale(1, 128, 64, seed=2)[0]
    packed = chord_indexed_scale(scale)
    assert packed.shape == (2, 128)
    assert_bitwise_equal(chord_indexed_scale_inverse(packed), scale, "2-D scale")


# --- grouped (§4.4) ----------------------------------------------------------------------------


GROUPED_SHAPES = [(2, 256, 512), (1, 64, 128), (3, 192, 256), (1, 128, 192)]


@pytest.mark.parametrize("mode", ["contiguous", "masked"])
@pytest.mark.parametrize("shape", GROUPED_SHAPES + [REAL_PARAM])
def test_grouped_weight_round_trip(shape, mode):
    e, n, k = shape
    if mode == "masked" and k % 128:
        pytest.skip("masked needs K % 128 == 0 (see test_divisibility_errors)")
    words = pack_codes(random_codes(e, n, k, seed=n + 3 * k))
    data = chord_grouped_weight(words, mode)
    assert data.dtype == torch.uint8 and data.shape == (e, n, k // 2)
    assert_bitwise_equal(chord_grouped_weight_inverse(data, mode), words, f"{mode} inverse")
    # Chord keeps the same bytes in a float8_e4m3fn view; the inverse accepts that view too
    back = chord_grouped_weight_inverse(data.view(torch.float8_e4m3fn), mode)
    assert_bitwise_equal(back, words, f"{mode} inverse of the fp8 view")


@pytest.mark.parametrize("mode,block_k", [("contiguous", 64), ("masked", 128)])
def test_grouped_weight_golden(mode, block_k):
    e, n, k = 2, 128, 256
    codes = random_codes(e, n, k, seed=13)
    data = chord_grouped_weight(pack_codes(codes), mode)
    for e_, n_src, k_src in [(0, 0, 0), (0, 1, 0), (0, 8, 0), (1, 0, 1), (1, 0, 16), (0, 63, 63),
                             (1, 64, 127), (0, 100, 200), (1, 127, 255), (0, 37, 66)]:
        row, col = spec_grouped_destination(n_src, k_src, block_k)
        byte = int(data[e_, row, col // 2])
        got = byte >> 4 if col % 2 else byte & 0xF
        want = int(codes[e_, n_src, k_src])
        assert got == want, (
            f"{mode}: code[{e_}, {n_src}, {k_src}] should sit at row {row} column {col}; "
            f"found {got}, want {want}"
        )


def test_grouped_weight_golden_bytes():
    # a single code per atom-local bit: where it lands pins the permutation
    codes = torch.zeros(1, 64, 64, dtype=torch.uint8)
    codes[0, 8, 0] = 0x3  # n3 -> column bit 0 (odd column: high nibble of byte 0)
    codes[0, 0, 16] = 0x5  # k4 -> row bit 3 (row 8, column 0: low nibble)
    codes[0, 0, 1] = 0x7  # k0 -> column bit 2 (column 4: byte 2 low)
    codes[0, 1, 8] = 0x9  # n0 -> row 1; k3 -> column bit 1 (column 2: byte 1 low)
    data = chord_grouped_weight(pack_codes(codes), "contiguous")[0]
    assert int(data[0, 0]) == 0x30 and int(data[8, 0]) == 0x05
    assert int(data[0, 2]) == 0x07 and int(data[1, 1]) == 0x09
    assert int(data.sum()) == 0x30 + 0x05 + 0x07 + 0x09


def test_grouped_bk64_equals_bk128_when_k_divisible_by_128():
    # format.md §4.4 claims identical bytes for K % 128 == 0 (packing.py's docstring disagrees).
    # With the atom permutation as written, k6 only sets column bit 6, so the claim holds.
    for shape in [(2, 256, 512), (1, 128, 128), (2, 64, 2048)]:
        words = pack_codes(random_codes(*shape, seed=17))
        assert_bitwise_equal(chord_grouped_weight(words, "contiguous"),
                             chord_grouped_weight(words, "masked"), f"BK64 vs BK128 {shape}")


def test_grouped_weight_is_not_the_checkpoint_order():
    words = pack_codes(random_codes(1, 64, 128, seed=19))
    plain = words.view(torch.uint8).view(1, 64, 64)  # checkpoint bytes, low nibble = even k
    assert not torch.equal(chord_grouped_weight(words, "contiguous"), plain)


@pytest.mark.parametrize("shape", GROUPED_SHAPES + [REAL_PARAM])
def test_grouped_scale_round_trip(shape):
    scale = random_scale(*shape, seed=1)
    packed = chord_grouped_scale(scale)
    assert packed.is_contiguous()
    assert_bitwise_equal(packed, scale.transpose(1, 2), "grouped scale = transpose")
    assert_bitwise_equal(chord_grouped_scale_inverse(packed), scale, "grouped scale inverse")
    assert_bitwise_equal(chord_grouped_scale(scale[0]), packed[0], "grouped scale 2-D")


# --- validation --------------------------------------------------------------------------------


def test_divisibility_errors():
    w = lambda n, k: torch.zeros(2, n, k // 8, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="N % 128"):
        chord_indexed_weight(w(64, 128))
    with pytest.raises(ValueError, match="K % 64"):
        chord_indexed_weight(w(128, 96), "wgmma")
    with pytest.raises(ValueError, match="N % 128"):
        chord_indexed_weight_inverse(torch.zeros(2, 8, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="layout"):
        chord_indexed_weight(w(128, 64), "wmma")
    with pytest.raises(ValueError, match="int32"):
        chord_indexed_weight(torch.zeros(128, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="2-D"):
        chord_indexed_weight(torch.zeros(1, 1, 128, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="N % 128"):
        chord_indexed_scale(torch.zeros(1, 64, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K % 128"):
        chord_grouped_weight(w(64, 192), "masked")
    chord_grouped_weight(w(64, 192), "contiguous")  # fine with BLOCK_K 64
    with pytest.raises(ValueError, match="K % 64"):
        chord_grouped_weight(w(64, 96), "contiguous")
    with pytest.raises(ValueError, match="N % 64"):
        chord_grouped_weight(w(32, 128), "contiguous")
    with pytest.raises(ValueError, match="mode"):
        chord_grouped_weight(w(64, 128), "grouped")
    with pytest.raises(ValueError, match="uint8"):
        chord_grouped_weight_inverse(torch.zeros(64, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="N % 64"):
        chord_grouped_scale(torch.zeros(1, 32, 4, dtype=torch.bfloat16))
