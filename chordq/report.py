"""How a :class:`chordq.verify.VerifyReport` is shown: terminal table, JSON file, PNG plot.

Everything here only formats figures that ``verify.py`` computed; nothing is checked here.
Files are written atomically (temporary file, then rename).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .writer import TMP_SUFFIX, write_json

if TYPE_CHECKING:  # pragma: no cover
    from .verify import VerifyReport

__all__ = ["write_report", "write_plot", "format_table", "format_summary"]

PROJ_COLOURS = {"gate_proj": "tab:blue", "up_proj": "tab:orange", "down_proj": "tab:green"}
MAX_LISTED = 10  # failures / warnings printed in the terminal summary


def write_report(report: VerifyReport, json_path: Path, plot: bool = True) -> None:
    """Write the JSON report (and the PNG plot next to it) and record their paths on the report."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    report.json_path = json_path
    if plot:
        report.plot_path = json_path.with_suffix(".png")
        write_plot(report, report.plot_path)
    write_json(json_path, report.to_json())


def _db(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "exact" if x > 0 else "-inf"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return f"{x:.2f}"


def _sci(x: Any) -> str:
    return "-" if x is None else f"{x:.1e}"


def format_table(report: VerifyReport) -> str:
    """One row per MoE layer: experts checked, SQNR min/mean, cos_diff, code 0, status."""
    head = (
        "layer",
        "experts",
        "computed",
        "sqnr min",
        "sqnr mean",
        "cos src",
        "cos kernel",
        "code0",
        "status",
    )
    rows = [head]
    for r in report.layers:
        rows.append(
            (
                str(r["layer"]),
                f"{r['experts_checked']}/{r['experts_expected']}",
                str(r["experts_computed"]),
                _db(r["sqnr_min_db"]),
                _db(r["sqnr_mean_db"]),
                _sci(r["cos_diff_source"]),
                _sci(r["cos_diff_kernel"]),
                "yes" if r["code0_used"] else "NO",
                r["status"].upper() if r["status"] != "pass" else "pass",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            c.rjust(w) if i < len(head) - 1 else c
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_summary(report: VerifyReport) -> str:
    """The table, then the failures and warnings (first few), the verdict and the files."""
    t = report.timing
    lines = [format_table(report), ""]
    for f in report.failures[:MAX_LISTED]:
        lines.append(f"FAIL  {f.message}")
    if report.num_failures > MAX_LISTED:
        lines.append(
            f"FAIL  ... {report.num_failures - MAX_LISTED} more (by check: {report.failure_counts})"
        )
    for w in report.warnings[:MAX_LISTED]:
        lines.append(f"warn  {w.message}")
    src = (
        f" against {report.source} ({report.source_format})"
        if report.source
        else " (structure only: no --source)"
    )
    verdict = "PASSED" if report.passed else f"FAILED ({report.num_failures} failures)"
    lines.append(
        f"{report.output}{src}: {verdict} in {t['seconds']:.1f}s "
        f"({(t['output_bytes_read'] + t['source_bytes_read']) / 1e6:.1f} MB read, compute "
        f"{t['compute_s']:.1f}s)"
    )
    files = [str(p) for p in (report.json_path, report.plot_path) if p]
    if files:
        lines.append("report: " + ", ".join(files))
    return "\n".join(lines)


def write_plot(report: VerifyReport, path: Path) -> None:
    """PNG: SQNR per layer (mean and min per projection, RTN mean dotted), SQNR per projection
    (box plot over all experts), and the code histogram (code 0 = q -8 in red)."""
    # The Agg canvas directly: no pyplot, so no global backend switch in the caller's process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(16, 4.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3, gridspec_kw={"width_ratios": [2.2, 1, 1.3]})
    ax_layer, ax_proj, ax_codes = axes
    fid = report.fidelity
    plotted = False
    per_proj: dict[str, list[float]] = {p: [] for p in PROJ_COLOURS}
    if fid.get("checked"):
        for proj, colour in PROJ_COLOURS.items():
            xs, means, mins, rtn = [], [], [], []
            for row in fid["layers"]:
                s = row["sqnr_db"][proj]
                vals = [v for v in row["sqnr_all_db"][proj] if v is not None and math.isfinite(v)]
                per_proj[proj] += vals
                if s["mean"] is None or not math.isfinite(s["mean"]):
                    continue
                xs.append(row["layer"])
                means.append(s["mean"])
                mins.append(s["min"])
                rtn.append(row["rtn_sqnr_db"][proj]["mean"])
            if xs:
                plotted = True
                ax_layer.plot(xs, means, "-o", color=colour, ms=3, label=f"{proj} mean")
                ax_layer.plot(xs, mins, "--", color=colour, lw=1, label=f"{proj} min")
                if all(v is not None for v in rtn):
                    ax_layer.plot(
                        xs, rtn, ":", color=colour, lw=1, alpha=0.7, label=f"{proj} RTN mean"
                    )
    codes = report.codes.get("layers", [])
    if plotted:
        from .verify import SQNR_FLOOR_DB

        ax_layer.axhline(SQNR_FLOOR_DB, color="red", lw=0.8, label=f"floor {SQNR_FLOOR_DB:g} dB")
        ax_layer.set_xlabel("MoE layer")
        ax_layer.set_ylabel("SQNR vs source (dB)")
        ax_layer.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_layer.legend(fontsize=6, ncol=3, loc="lower right")
        ax_layer.set_title("SQNR per layer")
    elif codes:
        # No SQNR to show: how each layer uses the 16 codes instead.
        why = "bit-exact copy of the native INT4 source" if fid.get("checked") else "no --source"
        frac = [[h / max(sum(row["histogram"]), 1) for h in row["histogram"]] for row in codes]
        im = ax_layer.imshow(
            list(map(list, zip(*frac, strict=True))),
            aspect="auto",
            origin="lower",
            cmap="viridis",
            extent=(codes[0]["layer"] - 0.5, codes[-1]["layer"] + 0.5, -8.5, 7.5),
        )
        fig.colorbar(im, ax=ax_layer, fraction=0.03, label="fraction of codes")
        ax_layer.set_xlabel("MoE layer")
        ax_layer.set_ylabel("q = code - 8")
        ax_layer.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_layer.set_title(f"code use per layer (SQNR: {why})")
    data = [per_proj[p] for p in PROJ_COLOURS]
    if any(data):
        ax_proj.boxplot(
            [d if d else [math.nan] for d in data],
            tick_labels=[p.replace("_proj", "") for p in PROJ_COLOURS],
        )
        ax_proj.set_ylabel("SQNR (dB), all experts")
        ax_proj.set_title("SQNR per projection")
    elif codes:
        for proj, colour in PROJ_COLOURS.items():
            h = [sum(row["per_projection"][proj][c] for row in codes) for c in range(16)]
            ax_proj.plot(
                range(-8, 8), [x / max(sum(h), 1) for x in h], "-o", ms=3, color=colour, label=proj
            )
        ax_proj.set_xlabel("q = code - 8")
        ax_proj.legend(fontsize=7)
        ax_proj.set_title("code use per projection")
    hist = [0] * 16
    for row in report.codes.get("layers", []):
        hist = [a + b for a, b in zip(hist, row["histogram"], strict=True)]
    total = sum(hist) or 1
    ax_codes.bar(range(16), [h / total for h in hist], color=["red"] + ["tab:gray"] * 15)
    ax_codes.set_xticks(range(16), [str(c - 8) for c in range(16)], fontsize=7)
    ax_codes.set_xlabel("q = code - 8 (red: code 0, Humming's fast-path marker)")
    ax_codes.set_title("code histogram (all checked layers)")
    status = "PASSED" if report.passed else f"FAILED ({report.num_failures})"
    fig.suptitle(f"chordq verify {report.output.name}: {status}", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        fig.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
