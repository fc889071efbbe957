"""Quantization math: the rtn oracle (compressed-tensors), mse never worse, edge cases."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams

from chordq.layout import pack_int4
from chordq.quant import GROUP_SIZE, dequantize, quantize, rtn_scales, sqnr_db

# Named floors for 4-bit group-32 on these synthetic weights (measured ~20.4 dB Gaussian).
SQNR_FLOOR_GAUSSIAN_DB = 19.5
MSE_GAIN_HEAVY_TAIL_DB = 0.3


def _heavy(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    c = sum(torch.randn(shape, generator=g) ** 2 for _ in range(3)) / 3
    return z / c.sqrt()


@pytest.mark.parametrize("shape", [(64, 256), (7, 96), (3, 5, 64)])
def test_rtn_matches_compressed_tensors(shape):
    """compressed-tensors' own minmax scale (BF16) and compressor give our words exactly."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    w2 = w.reshape(-1, shape[-1])
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32,
                            scale_dtype=torch.bfloat16)
    g = w2.reshape(w2.shape[0], -1, GROUP_SIZE)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    ref = PackedQuantizationCompressor.compress(
        {"weight": w2, "weight_scale": scale, "weight_zero_point": zp},
        QuantizationScheme(targets=["Linear"], weights=args),
    )
    q, s = quantize(w, "rtn")
    assert s.dtype == torch.bfloat16
    assert torch.equal(s.reshape(scale.shape).float(), scale.float())
    assert torch.equal(pack_int4(q).reshape(ref["weight_packed"].shape), ref["weight_packed"])


def test_rtn_semantics():
    w = torch.randn(16, 128)
    q, s = quantize(w, "rtn")
    assert q.dtype == torch.int8 and q.min() >= -8 and q.max() <= 7
    assert torch.equal(s, (w.reshape(16, 4, 32).abs().amax(-1) / 7.5).to(torch.bfloat16))
    assert torch.equal(s, rtn_scales(w))
    # codes are computed from the BF16-rounded scale
    expect = torch.clamp(torch.round(w.reshape(16, 4, 32) / s.float()[..., None]), -8, 7)
    assert torch.equal(q, expect.reshape(16, 128).to(torch.int8))


@pytest.mark.parametrize("seed", range(4))
def test_mse_never_worse_than_rtn_per_group(seed):
    w = _heavy((128, 512), seed)
    qr, sr = quantize(w, "rtn")
    qm, sm = quantize(w, "mse")
    err_r = (w - dequantize(qr, sr)).reshape(128, 16, 32).square().sum(-1)
    err_m = (w - dequantize(qm, sm)).reshape(128, 16, 32).square().sum(-1)
    assert (err_m <= err_r).all()


def test_mse_clearly_better_on_heavy_tails():
    w = _heavy((256, 1024), 7)
    rtn = sqnr_db(w, dequantize(*quantize(w, "rtn")))
    mse = sqnr_db(w, dequantize(*quantize(w, "mse")))
    assert mse >= rtn + MSE_GAIN_HEAVY_TAIL_DB, (rtn, mse)


def test_sqnr_floor_gaussian():
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    for method in ("rtn", "mse"):
        assert sqnr_db(w, dequantize(*quantize(w, method))) > SQNR_FLOOR_GAUSSIAN_DB


def test_zero_group_and_outlier():
    w = torch.zeros(2, 64)
    w[1, 40] = 1000.0
    # rtn maps +absmax to 7.5 and clamps it to 7 (-6.7%); the /7 grid of mse represents it.
    for method, rel in (("rtn", 0.08), ("mse", 0.01)):
        q, s = quantize(w, method)
        assert torch.isfinite(s.float()).all() and (s != 0).all()
        assert torch.equal(dequantize(q, s)[0], torch.zeros(64))
        assert dequantize(q, s)[1, 40] == pytest.approx(1000.0, rel=rel)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="not divisible"):
        quantize(torch.randn(4, 48), "rtn")
    w = torch.randn(4, 64)
    w[2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize(w, "mse")


def test_bf16_and_3d_inputs():
    w = torch.randn(3, 32, 64).to(torch.bfloat16)
    q, s = quantize(w, "mse")
    assert q.shape == (3, 32, 64) and s.shape == (3, 32, 2)
    q2, s2 = quantize(w[1], "mse")
    assert torch.equal(q[1], q2) and torch.equal(s[1], s2)
