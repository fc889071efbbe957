"""Print the SQNR of --method rtn and --method mse on a fixed synthetic weight set (README table).

    python scripts/sqnr_table.py
"""

from __future__ import annotations

import torch

from chordq.quant import dequantize, quantize, sqnr_db

ROWS, COLS = 2048, 7168 // 4  # a quarter of a real K2 gate_proj, to keep the run short


def synthetic_set() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    shape = (ROWS, COLS)
    normal = torch.randn(shape, generator=g)

    def student_t(df: int) -> torch.Tensor:
        chi2 = sum(torch.randn(shape, generator=g) ** 2 for _ in range(df)) / df
        return torch.randn(shape, generator=g) / chi2.sqrt()

    laplace = torch.distributions.Laplace(0.0, 1.0).icdf(torch.rand(shape, generator=g).clamp(1e-7, 1 - 1e-7))
    outliers = normal.clone()
    mask = torch.rand(shape, generator=g) < 1e-3
    outliers[mask] *= 20
    return {
        "gaussian": normal,
        "laplace": laplace,
        "student-t df=5": student_t(5),
        "student-t df=3": student_t(3),
        "gaussian + 0.1% 20x outliers": outliers,
    }


def main() -> None:
    print("| weights | rtn SQNR (dB) | mse SQNR (dB) | mse gain (dB) |")
    print("|---|---:|---:|---:|")
    for name, w in synthetic_set().items():
        rtn = sqnr_db(w, dequantize(*quantize(w, "rtn")))
        mse = sqnr_db(w, dequantize(*quantize(w, "mse")))
        print(f"| {name} | {rtn:.2f} | {mse:.2f} | {mse - rtn:+.2f} |")


if __name__ == "__main__":
    main()
