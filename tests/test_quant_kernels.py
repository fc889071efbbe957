"""The fused quantizers (numba CPU, Triton GPU/interpreter) against the PyTorch oracle, bit for bit."""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU runs interpret

from chordq.kernels.cpu_quant import quantize_packed_cpu
from chordq.layout import pack_int4
from chordq.quant import quantize, sqnr_db, dequantize
from chordq.sources import dequant_fp8_block
from make_tiny_kimi import fp8_block_quantize

CUDA = torch.cuda.is_available()


def heavy(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) / (torch.rand(shape, generator=g) + 0.05)
    return w.to(dtype)


def oracle(w_float: torch.Tensor, method: str):
    q, s = quantize(w_float, method)
    return pack_int4(q), s, sqnr_db(w_float, dequantize(q, s))


def assert_same(got, want, what):
    words, scale = got[0].cpu(), got[1].cpu()
    mism = (words != want[0]).nonzero()
    assert mism.numel() == 0, f"{what}: first word mismatch at {mism[0].tolist()}"
    assert torch.equal(scale, want[1]), f"{what}: scales differ"
    assert got[2] == pytest.approx(want[2], rel=1e-9)


@pytest.mark.parametrize("method", ["rtn", "mse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_matches_oracle(method, dtype):
    w = heavy((96, 512), 1, dtype)
    assert_same(quantize_packed_cpu(w, method), oracle(w.float(), method), f"{dtype} {method}")


@pytest.mark.parametrize("method", ["rtn", "mse"])
def test_cpu_kernel_fp8_fused_dequant(method):
    w = heavy((200, 384), 2) * 0.01  # 200 rows: a partial 128-row FP8 block
    f8, sinv = fp8_block_quantize(w)
    got = quantize_packed_cpu(f8, method, scale_inv=sinv)
    assert_same(got, oracle(dequant_fp8_block(f8, sinv), method), f"fp8 {method}")


def test_cpu_kernel_edge_values():
    w = torch.randn(8, 128)
    w[0] = 0.0  # all-zero row
    w[1, :32] = 1e-40  # subnormal group
    w[2, 5] = 3e38  # near float32 max
    w[3, :32] = torch.linspace(-1, 1, 32)
    for method in ("rtn", "mse"):
        got = quantize_packed_cpu(w, method)
        assert_same(got, oracle(w, method), f"edges {method}")
        assert got[3] == 0


def test_cpu_kernel_counts_nonfinite():
    w = torch.randn(4, 64)
    w[1, 3], w[2, 40] = float("nan"), float("-inf")
    assert quantize_packed_cpu(w, "mse")[3] == 2


@pytest.mark.parametrize("method", ["rtn", "mse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_oracle(method, dtype):
    from chordq.kernels.triton_quant import quantize_packed_triton

    device = "cuda" if CUDA else "cpu"
    w = heavy((16, 128) if not CUDA else (512, 7168), 3, dtype)
    got = quantize_packed_triton(w.to(device), method)
    assert_same(got, oracle(w.float(), method), f"triton {dtype} {method}")


def test_triton_kernel_fp8_and_nonfinite():
    from chordq.kernels.triton_quant import quantize_packed_triton

    device = "cuda" if CUDA else "cpu"
    w = heavy((130, 128), 4) * 0.01
    f8, sinv = fp8_block_quantize(w)
    got = quantize_packed_triton(f8.to(device), "rtn", scale_inv=sinv.to(device))
    assert_same(got, oracle(dequant_fp8_block(f8, sinv), "rtn"), "triton fp8")
    bad = torch.randn(4, 64)
    bad[0, 0] = float("nan")
    assert quantize_packed_triton(bad.to(device), "rtn")[3] == 1
    assert math.isfinite(got[2])
