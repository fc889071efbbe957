"""chordq's Triton W4A16 MoE GEMMs against humming-kernels, same process, same inputs (issue 8).

What runs (kernels.md §4-§5):

* **Same inputs.** One set of packed int32 words ``[E, N, K/8]`` (random, every word holds 8
  codes over all 16 levels, and each expert's first two words are 0x76543210 / 0xFEDCBA98 so
  code 0 surely occurs: Humming keeps its ``uint4`` path; without code 0 ``transform()``
  switches to the 22-29% slower ``float4e0m3`` path, which this module refuses to time) and BF16
  group-32 scales are handed to chordq and to ``HummingLayer.load_from_tensors``.
* **Same routing.** One uniform top-8 draw per (layout, T), shared by gate_up and down, aligned
  separately to each kernel's own block size: chordq's ``choose_row_tiles`` blocks with
  ``chordq.kernels.align.align_row_tiles`` (``moe_align_block_size``, or ``moe_align_mixed``
  at 128-256 rows per expert), Humming's heuristic ``block_shape[0]`` with
  ``humming.testing.data.generate_moe_tensors`` (chordq's aligner as a fallback; same contract).
* **Shapes.** EP8 (48 local experts): gate_up N=4096 K=7168, down N=7168 K=2048. TP8 (384
  experts): gate_up N=512 K=7168, down N=7168 K=256. T tokens per GPU, 8T routed rows.
* **GEMM to GEMM.** Humming's gate_up writes ``8T x 2I``; chordq's gate_up is timed with
  ``activation=None`` so it writes the same ``8T x 2I``. chordq's shipped kernel (SiLU-and-mul
  fused, ``8T x I``) is timed too, in its own column ("chordq fused"); vLLM's Humming path needs
  a separate silu_and_mul launch on top of its gate_up time.
* **Correctness first.** Every output is compared with ``moe_gemm_indexed_reference`` (BF16
  dequant, FP32 accumulate) by ``cos_diff`` before timing, on the rows of a subset of experts
  (all routes while 8T <= ``check_routes``, otherwise experts taken alternately from both ends
  of the touched ids until ``check_routes`` routes are covered: the FP32 reference is slow).
* **Timing.** Primary: CUDA-graph replay of ``calls`` back-to-back calls, ``reps`` interleaved
  A/B repetitions (order alternates every repetition), median. Secondary:
  ``triton.testing.do_bench`` mean (L2 flushed), shortened by default (warmup 25 / rep 200 ms
  instead of kernels.md's 100 / 1000).
* **Floor.** kernels.md §3: ``max(bytes / 4.28 TB/s, FLOPs / 792 TFLOP/s)`` with bytes = touched
  experts x (int4 words + BF16 scales) + BF16 input + BF16 ``8T x N`` output; the same model at
  TP8 shapes. ``ratio`` = chordq µs / Humming µs (below 1: chordq is faster).

Every Humming step runs in try/except: what failed is printed, recorded in the JSON, and the
run continues with chordq-only numbers. Results are rewritten to ``--out`` after every row, so
a run cut short by a timeout keeps what it measured.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ALL_TOKENS",
    "DEFAULT_TOKENS",
    "LAYOUTS",
    "Problem",
    "check_subset",
    "draw_routing",
    "expected_touched",
    "floor_model",
    "install_humming",
    "interleave_order",
    "make_weights",
    "pick_interval",
    "run_comparison",
]

TOP_K = 8
GROUP_SIZE = 32
HBM_BYTES_PER_S = 4.28e12  # measured H200 copy bandwidth (kernels.md §3)
BF16_FLOPS = 792e12  # measured cuBLAS BF16 at 8192^3
DATASHEET_BYTES_PER_S = 4.8e12
DATASHEET_FLOPS = 989e12
MAX_COS_DIFF = 1e-3
DEFAULT_TOKENS = (1, 8, 20, 32, 128, 256, 512, 1024, 2048, 8192)
ALL_TOKENS = DEFAULT_TOKENS
EXPECTED_HUMMING_VERSION = "0.1.19"
HUMMING_COMPUTE_CONFIG = json.dumps({"gemm_type": "indexed"})
HUMMING_WEIGHT_CONFIG = {"quant_method": "humming", "dtype": "uint4", "group_size": GROUP_SIZE,
                         "scale_dtype": "bfloat16"}
WHEEL_GLOB = "humming_kernels-*.whl"
# Two words that hold all 16 codes between them (lowest nibble first).
ALL_LEVEL_WORDS = (0x76543210, 0xFEDCBA98 - (1 << 32))


@dataclasses.dataclass(frozen=True)
class Problem:
    """One projection of one parallel layout: ``8T`` routed rows x ``[E, N, K]`` weights."""

    layout: str  # "EP8" or "TP8"
    proj: str  # "gate_up" (input [T, K], top_k 8) or "down" (input [8T, K], top_k 1)
    num_experts: int
    n: int
    k: int

    @property
    def key(self) -> str:
        return f"{self.layout}/{self.proj}"

    @property
    def top_k(self) -> int:
        """The ``top_k`` argument of the indexed GEMM: route r reads input row r // top_k."""
        return TOP_K if self.proj == "gate_up" else 1

    def input_rows(self, tokens: int) -> int:
        return tokens if self.proj == "gate_up" else TOP_K * tokens


LAYOUTS: dict[str, tuple[Problem, Problem]] = {
    "EP8": (Problem("EP8", "gate_up", 48, 4096, 7168), Problem("EP8", "down", 48, 7168, 2048)),
    "TP8": (Problem("TP8", "gate_up", 384, 512, 7168), Problem("TP8", "down", 384, 7168, 256)),
}


def _log(msg: str = "") -> None:
    print(msg, flush=True)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ pure helpers (CPU-tested)


def expected_touched(num_experts: int, tokens: int, top_k: int = TOP_K) -> float:
    """Expected experts hit by ``tokens`` uniform top-k draws: ``E (1 - (1 - k/E)^T)``."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def floor_model(p: Problem, tokens: int, touched: float) -> dict[str, Any]:
    """kernels.md §3 bytes/FLOP floor of one indexed GEMM call.

    bytes = touched x (N K / 2 int4 + N K/32 BF16 scales) + BF16 input rows + BF16 ``8T x N``
    output; FLOPs = ``2 8T N K``. Floor = max(bytes / 4.28 TB/s, FLOPs / 792 TFLOP/s); the
    datasheet floor uses 4.8 TB/s and 989 TFLOP/s.
    """
    weight = touched * (p.n * p.k // 2 + p.n * (p.k // GROUP_SIZE) * 2)
    rows = TOP_K * tokens
    act = p.input_rows(tokens) * p.k * 2 + rows * p.n * 2
    bytes_ = float(weight + act)
    flops = 2.0 * rows * p.n * p.k
    mem_us, comp_us = bytes_ / HBM_BYTES_PER_S * 1e6, flops / BF16_FLOPS * 1e6
    return {
        "bytes": bytes_, "flops": flops, "floor_us": max(mem_us, comp_us),
        "bound": "memory" if mem_us >= comp_us else "compute",
        "datasheet_floor_us": max(bytes_ / DATASHEET_BYTES_PER_S, flops / DATASHEET_FLOPS) * 1e6,
    }


def routing_seed(seed: int, layout: str, tokens: int) -> int:
    """A seed per (layout, T), so a draw does not depend on which other shapes ran."""
    return zlib.crc32(f"{seed}/{layout}/{tokens}".encode())


def draw_routing(tokens: int, num_experts: int, top_k: int = TOP_K, seed: int = 0) -> torch.Tensor:
    """Uniform top-k of ``num_experts`` distinct experts per token: int32 ``[T, top_k]`` on CPU."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=gen)
    return scores.topk(top_k, dim=-1).indices.to(torch.int32)


def pick_interval(configs: Sequence, rows: int) -> dict:
    """The config of the ``(lo, hi, cfg)`` interval with ``lo < rows <= hi`` (Humming's rule)."""
    for entry in configs:
        lo, hi, cfg = entry[0], entry[1], entry[2]
        if lo < rows <= hi:
            return cfg
    raise ValueError(f"no heuristic interval holds {rows} rows: "
                     f"{[(e[0], e[1]) for e in configs]}")


def check_subset(topk_ids: torch.Tensor, max_routes: int) -> tuple[list[int], torch.Tensor]:
    """Experts whose rows are checked against the reference, and the mask of their routes.

    Every touched expert while the routes fit in ``max_routes``; otherwise experts taken
    alternately from the highest and lowest touched ids (offset bugs show at high ids) until
    at least ``max_routes`` routes are covered.
    """
    flat = topk_ids.reshape(-1).long()
    counts = torch.bincount(flat[flat >= 0])
    touched = [int(e) for e in torch.nonzero(counts).flatten().tolist()]
    order, lo, hi = [], 0, len(touched) - 1
    while lo <= hi:
        order.append(touched[hi])
        if lo != hi:
            order.append(touched[lo])
        lo, hi = lo + 1, hi - 1
    chosen, total = [], 0
    for e in order:
        if chosen and total >= max_routes:
            break
        chosen.append(e)
        total += int(counts[e])
    chosen.sort()
    mask = torch.isin(flat, torch.tensor(chosen, dtype=torch.long, device=flat.device))
    return chosen, mask


def interleave_order(names: Sequence[str], reps: int) -> list[str]:
    """A/B order over repetitions: forward on even reps, reversed on odd ones."""
    out: list[str] = []
    for rep in range(reps):
        out += list(names) if rep % 2 == 0 else list(names)[::-1]
    return out


def make_weights(p: Problem, seed: int, device: str | torch.device) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """Seeded int32 words ``[E, N, K/8]`` (all 16 levels) and BF16 scales ``[E, N, K/32]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (p.num_experts, p.n, p.k // 8)
    words = torch.randint(-2**31, 2**31, shape, generator=gen, dtype=torch.int64,
                          device=device).to(torch.int32)
    for j, w in enumerate(ALL_LEVEL_WORDS[: shape[2]]):
        words[:, 0, j] = w
    scales = (0.01 * torch.exp2(0.5 * torch.randn(p.num_experts, p.n, p.k // GROUP_SIZE,
                                                  generator=gen, device=device)))
    return words, scales.to(torch.bfloat16)


def levels_present(words: torch.Tensor) -> int:
    """Distinct codes among each expert's first row of words (cheap; should be 16)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    codes = (words[:, 0, :].unsqueeze(-1) >> shifts) & 0xF
    return int(torch.unique(codes).numel())


def compare_rows(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """cos_diff and max relative error (max |got - want| / max |want|) over ``mask`` rows."""
    from .reference import cos_diff

    g, w = got[mask].float(), want[mask].float()
    cos = cos_diff(g, w)
    scale = float(w.abs().max()) if w.numel() else 0.0
    rel = float((g - w).abs().max()) / scale if scale else 0.0
    finite = bool(torch.isfinite(g).all())
    return {"cos_diff": cos, "max_rel_err": rel, "finite": finite,
            "ok": finite and cos <= MAX_COS_DIFF}


# ------------------------------------------------------------------ humming: install and import


def install_humming(path: str | os.PathLike, target: str | os.PathLike | None = None,
                    use_pip: bool = True, log: Callable[[str], None] = _log) -> Path:
    """Make humming importable from ``path``; returns the folder to put on ``sys.path``.

    ``path`` may be a wheel (installed with ``pip install --no-deps --no-index --target``, as in
    kernels.md §4 step 1; unzipped with its file modes if pip fails), a folder holding such a
    wheel, a folder holding ``humming/`` (a ``--target`` dir), or the ``humming`` folder itself.
    """
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        if (p / "humming" / "__init__.py").exists():
            return p
        if p.name == "humming" and (p / "__init__.py").exists():
            return p.parent
        wheels = sorted(p.glob(WHEEL_GLOB))
        if not wheels:
            raise FileNotFoundError(f"{p} holds neither humming/ nor {WHEEL_GLOB}")
        p = wheels[-1]
    if not p.is_file():
        raise FileNotFoundError(f"humming wheel {p} does not exist")
    dest = Path(target) if target else Path(tempfile.mkdtemp(prefix="chordq-humming-"))
    dest.mkdir(parents=True, exist_ok=True)
    if use_pip:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
               "--disable-pip-version-check", "-q", "--upgrade", "--target", str(dest), str(p)]
        t0 = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if res.returncode == 0 and (dest / "humming" / "__init__.py").exists():
                log(f"installed {p.name} into {dest} with pip ({time.perf_counter() - t0:.1f} s)")
                return dest
            log(f"pip install failed (rc {res.returncode}): {(res.stderr or res.stdout)[-800:]}")
        except (OSError, subprocess.SubprocessError) as exc:
            log(f"pip install failed: {_err(exc)}")
        log("falling back to unzipping the wheel")
    with zipfile.ZipFile(p) as z:
        z.extractall(dest)
        for info in z.infolist():  # extractall drops the mode bits (humming ships binaries)
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                (dest / info.filename).chmod(mode)
    if not (dest / "humming" / "__init__.py").exists():
        raise FileNotFoundError(f"{p.name} unpacked to {dest} holds no humming/__init__.py")
    log(f"unzipped {p.name} into {dest}")
    return dest


def import_humming(root: Path | None, log: Callable[[str], None] = _log):
    """Import ``humming`` from ``root`` (first on sys.path; any humming already imported from
    elsewhere, e.g. Chord's, is dropped). Returns (module, info dict)."""
    if root is not None:
        root = Path(root).resolve()
        sys.path.insert(0, str(root))
        stale = [m for m in sys.modules if m == "humming" or m.startswith("humming.")]
        old = sys.modules.get("humming")
        if stale and not str(getattr(old, "__file__", "")).startswith(str(root)):
            log(f"dropping {len(stale)} humming modules already imported from "
                f"{getattr(old, '__file__', '?')}")
            for m in stale:
                del sys.modules[m]
        importlib.invalidate_caches()
    hm = importlib.import_module("humming")
    file = str(Path(getattr(hm, "__file__", "") or "").resolve())
    info = {"file": file, "version": getattr(hm, "__version__", None), "root": str(root)}
    if root is not None and not file.startswith(str(root)):
        raise ImportError(f"imported humming from {file}, not from {root}")
    if info["version"] != EXPECTED_HUMMING_VERSION:
        log(f"warning: humming version {info['version']}, kernels.md describes "
            f"{EXPECTED_HUMMING_VERSION}")
    return hm, info


def _dtype_name(dt: Any) -> str:
    return str(getattr(dt, "dtype_str", "") or dt)


def build_humming_layer(p: Problem, words: torch.Tensor, scales: torch.Tensor,
                        log: Callable[[str], None] = _log) -> tuple[Any, dict]:
    """HummingLayer for ``p`` loaded with chordq's words and scales, transformed (uint4 only)."""
    layer_mod = importlib.import_module("humming.layer")
    info: dict[str, Any] = {}
    t0 = time.perf_counter()
    layer = layer_mod.HummingLayer(shape_n=p.n, shape_k=p.k, num_experts=p.num_experts,
                                   weight_config=dict(HUMMING_WEIGHT_CONFIG),
                                   torch_dtype=torch.bfloat16).to(words.device)
    expected = {name: (tuple(t.shape), t.dtype) for name, t in layer.state_dict().items()}
    info["expected_tensors"] = {k: [list(s), str(d)] for k, (s, d) in expected.items()}
    for name, t in (("weight", words), ("weight_scale", scales)):
        if name not in expected:
            raise KeyError(f"HummingLayer has no {name!r} (has {sorted(expected)})")
        if expected[name][1] != t.dtype:  # load_state_dict would convert silently
            raise TypeError(f"HummingLayer {name} is {expected[name][1]}, chordq's is {t.dtype}")
    checksum = int(words.sum(dtype=torch.int64))
    layer.load_from_tensors({"weight": words, "weight_scale": scales})
    layer.transform()
    _sync(words.device)
    info["build_s"] = time.perf_counter() - t0
    if int(words.sum(dtype=torch.int64)) != checksum:
        raise RuntimeError("HummingLayer modified chordq's weight tensor in place")
    b_dtype = _dtype_name(layer.humming_config.b_dtype)
    info["b_dtype"] = b_dtype
    log(f"humming {p.key}: layer.humming_config.b_dtype = {b_dtype} "
        f"(built in {info['build_s']:.1f} s)")
    if b_dtype != "uint4":
        bar = "!" * 100
        log(f"{bar}\nHUMMING {p.key}: b_dtype is {b_dtype}, NOT uint4: Humming would run its "
            f"slower float4e0m3 path (kernels.md §1 pitfall).\n"
            f"Humming numbers for {p.key} are disabled.\n{bar}")
        raise RuntimeError(f"Humming b_dtype is {b_dtype}, not uint4")
    return layer, info


def humming_config(layer: Any, rows: int, cache: dict) -> tuple[dict, str]:
    """Humming's default heuristic config for ``rows`` routed rows (kernels.md §4 step 4)."""
    tune = importlib.import_module("humming.tune")
    try:
        if id(layer) not in cache:
            cache[id(layer)] = tune.get_heuristics_config(layer.humming_config, gemm_type="indexed")
        return dict(pick_interval(cache[id(layer)], rows)), "interval list"
    except Exception as exc:  # noqa: BLE001 - fall back to the single-shape call
        _log(f"humming heuristic interval list failed ({_err(exc)}); asking for shape_m={rows}")
        cfg = tune.get_heuristics_config(layer.humming_config, shape_m=rows, gemm_type="indexed")
        return dict(cfg), "shape_m"


def humming_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Humming's own indexed alignment (kernels.md §4 step 5), chordq's aligner as fallback."""
    try:
        data = importlib.import_module("humming.testing.data")
        _, _, sorted_ids, expert_ids, ntp = data.generate_moe_tensors(
            topk_ids, num_experts, "indexed", block_size_config=block_m)
        return (sorted_ids, expert_ids, ntp), "humming.testing.data.generate_moe_tensors"
    except Exception as exc:  # noqa: BLE001
        from .align import moe_align_block_size

        _log(f"humming generate_moe_tensors failed ({_err(exc)}); using chordq's aligner")
        return (moe_align_block_size(topk_ids, block_m, num_experts),
                f"chordq moe_align_block_size (humming's failed: {_err(exc)})")


def describe_humming_config(cfg: dict) -> str:
    shape = cfg.get("block_shape")
    text = f"({','.join(str(v) for v in shape)})" if shape else "?"
    text += f" {cfg.get('mma_type', '?')} x{cfg.get('num_ctas_per_sm', 1)}"
    if cfg.get("use_warp_spec"):
        text += " ws"
    if cfg.get("use_stream_k"):
        text += " sk"
    return text


# ------------------------------------------------------------------ timing (CUDA)


def capture_graph(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def time_graphs(fns: dict[str, Callable[[], object]], reps: int, calls: int) -> dict[str, dict]:
    """Median µs per call for each contestant, repetitions interleaved (A B, B A, A B, ...)."""
    out: dict[str, dict] = {}
    graphs = {}
    for name, fn in fns.items():
        try:
            graphs[name] = capture_graph(fn, calls)
        except Exception as exc:  # noqa: BLE001
            out[name] = {"graph_error": _err(exc)}
            _log(f"  graph capture of {name} failed: {_err(exc)}")
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    for name in interleave_order(list(graphs), reps):
        try:
            samples[name].append(replay_us(graphs[name], calls))
        except Exception as exc:  # noqa: BLE001
            out.setdefault(name, {})["graph_error"] = _err(exc)
    for name, ts in samples.items():
        if ts:
            out.setdefault(name, {}).update(graph_us=statistics.median(ts), graph_reps=ts)
    del graphs
    return out


def time_do_bench(fns: dict[str, Callable[[], object]], warmup: int, rep: int) -> dict[str, dict]:
    import triton.testing

    out: dict[str, dict] = {}
    for name, fn in fns.items():
        try:
            ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="mean")
            out[name] = {"do_bench_us": ms * 1e3}
        except Exception as exc:  # noqa: BLE001
            out[name] = {"do_bench_error": _err(exc)}
            _log(f"  do_bench of {name} failed: {_err(exc)}")
    return out


# ------------------------------------------------------------------ one shape


# every contestant a row may hold (``bench_shape``): its results, report lines and exit status
CONTESTANTS = ("chordq", "chordq_fused", "chordq_alt", "humming")


@dataclasses.dataclass
class Options:
    # even: the order alternates, so each contestant runs first in half the repetitions (with
    # 3, a 3-repetition table read a row at 1.16 where the Humming-first one drifted, §26)
    reps: int = 6
    calls: int = 20
    do_bench: bool = True
    do_bench_warmup: int = 25
    do_bench_rep: int = 200
    fused: bool = True
    check_routes: int = 2048
    seed: int = 0
    w_order: str = "blocked"  # chordq's weights: converted once, like Humming's transform()
    # "chordq_alt": chordq again with these triton_config constants in force while its launches
    # are chosen and captured (e.g. {"GLUON_PREFILL_STREAM_K_ROWS": (64, 96)}), timed in the
    # same interleaved graphs: an A/B of a heuristic setting in one process
    alt: dict[str, tuple[float, ...]] | None = None


@contextlib.contextmanager
def config_overrides(values: dict[str, tuple[float, ...]] | None):
    """``triton_config`` module constants set to ``values`` inside the block (the heuristics
    read them at each call), restored after."""
    from . import triton_config

    old = {name: getattr(triton_config, name) for name in values or {}}
    try:
        for name, value in (values or {}).items():
            setattr(triton_config, name, tuple(value))
        yield
    finally:
        for name, value in old.items():
            setattr(triton_config, name, value)


def convert_weights(words: torch.Tensor, scales: torch.Tensor, w_order: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint words and scales -> the layout ``w_order`` names (untimed, once per shape)."""
    from chordq.layout import fragment_order, row_blocks, subnormal_scales

    if w_order == "checkpoint":
        return words, scales
    if w_order == "fragments":
        return fragment_order(words), scales
    words, scales = fragment_order(words), subnormal_scales(scales)
    if w_order == "blocked":
        k = 8 * words.shape[-1]
        return row_blocks(words, k), row_blocks(scales, k)
    return words, scales


def bench_shape(p: Problem, tokens: int, topk_ids: torch.Tensor, words: torch.Tensor,
                scales: torch.Tensor, humming: dict | None, opts: Options,
                chordq_weights: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> dict[str, Any]:
    """Check, then time, chordq (and Humming when ``humming`` holds a layer) at one shape.

    :param words: checkpoint-order words (Humming's input and the reference's)
    :param humming: ``{"layer": HummingLayer, "cfg_cache": {}}``, ``{"error": str}`` or None
    :param chordq_weights: the same words and scales in ``opts.w_order`` (default: ``words``,
        ``scales``)
    """
    from .align import align_row_tiles, moe_align_block_size
    from .reference import moe_gemm_indexed_reference, silu_and_mul_reference
    from .triton_w4a16 import indexed_config, moe_gemm_mixed_triton, row_tiles

    dev = words.device
    chordq_words, chordq_scales = chordq_weights or (words, scales)
    rows = TOP_K * tokens
    rows_per_expert = rows / p.num_experts
    touched = int(torch.unique(topk_ids).numel())
    fl = floor_model(p, tokens, touched)
    row: dict[str, Any] = {
        "layout": p.layout, "tokens": tokens, "projection": p.proj, "num_experts": p.num_experts,
        "n": p.n, "k": p.k, "rows_per_expert": round(rows_per_expert, 2),
        "experts_touched": touched, **fl,
    }
    gen = torch.Generator(device=dev).manual_seed(routing_seed(opts.seed + 1, p.key, tokens))
    x = torch.randn(p.input_rows(tokens), p.k, generator=gen, device=dev).to(torch.bfloat16)
    fns: dict[str, Callable[[], object]] = {}
    outputs: dict[str, torch.Tensor] = {}

    # chordq: plain GEMM (what Humming computes) and, for gate_up, the shipped fused kernel.
    variants = [("chordq", None)] + ([("chordq_fused", "silu_mul")]
                                     if opts.fused and p.proj == "gate_up" else [])
    variants += [("chordq_alt", None)] if opts.alt else []
    ref_aligned = None
    for name, act in variants:
        res: dict[str, Any] = {}
        row[name] = res
        overrides = opts.alt if name == "chordq_alt" else None
        try:
            gated = act is not None
            n_out = p.n // 2 if gated else p.n
            # The shipped path: the heuristic's row tiles (one size, or several with one launch
            # per size) and config=None, so the wrapper's heuristic (and split-K) decide.
            with config_overrides(overrides):  # the row tiles too (GLUON_DECODE_HALVE_RPE)
                pieces = align_row_tiles(topk_ids, row_tiles(rows_per_expert, n_out, p.k,
                                                             p.num_experts, dev, opts.w_order,
                                                             gated=gated), p.num_experts)
                labels = [indexed_config(rows, p.num_experts, n_out, p.k, bm, activation=act,
                                         w_order=opts.w_order, device=dev,
                                         live_blocks=a[1].numel()).label
                          for bm, a in pieces]
            out = torch.empty(rows, n_out, dtype=torch.bfloat16, device=dev)
            res.update(config=" + ".join(labels), block_m=pieces[0][0])

            def fn(pieces=pieces, out=out, act=act, overrides=overrides):
                with config_overrides(overrides):  # a graph keeps the launches captured here
                    return moe_gemm_mixed_triton(x, chordq_words, chordq_scales, pieces,
                                                 p.top_k, activation=act, out=out,
                                                 w_order=opts.w_order)

            t0 = time.perf_counter()
            fn()
            _sync(dev)
            res["first_call_s"] = time.perf_counter() - t0
            fns[name], outputs[name] = fn, out
            if ref_aligned is None and len(pieces) == 1:
                ref_aligned = (pieces[0][1], pieces[0][0])
        except Exception as exc:  # noqa: BLE001
            res["error"] = _err(exc)
            res["traceback"] = traceback.format_exc()
            _log(f"  {name} {p.key} T={tokens} FAILED: {_err(exc)}")

    # Humming: its own heuristic config and block size, same draw.
    if humming is None:
        row["humming"] = {"error": "not requested"}
    elif "error" in humming:
        row["humming"] = {"error": humming["error"]}
    else:
        res = {}
        row["humming"] = res
        try:
            layer = humming["layer"]
            cfg, source = humming_config(layer, rows, humming["cfg_cache"])
            block_m = int(cfg["block_shape"][0])
            res.update(config=describe_humming_config(cfg), block_m=block_m, config_source=source,
                       tuning_config=cfg)
            (sorted_ids, expert_ids, ntp), align_source = humming_align(topk_ids, p.num_experts,
                                                                         block_m)
            res["align_source"] = align_source
            valid = int((sorted_ids < rows).sum())
            if valid != rows:
                raise RuntimeError(f"Humming's alignment holds {valid} valid route ids, not {rows}")
            out = torch.empty(rows, p.n, dtype=torch.bfloat16, device=dev)
            cfg_json = json.dumps(cfg)

            def hfn(out=out, sorted_ids=sorted_ids, expert_ids=expert_ids, ntp=ntp):
                return layer(x, outputs=out, sorted_ids=sorted_ids, expert_ids=expert_ids,
                             num_tokens_padded=ntp, top_k=p.top_k,
                             compute_config=HUMMING_COMPUTE_CONFIG, tuning_config=cfg_json)

            t0 = time.perf_counter()
            got = hfn()
            _sync(dev)
            res["first_call_s"] = time.perf_counter() - t0
            if got is not None and got.data_ptr() != out.data_ptr():
                res["note"] = "humming returned a new tensor instead of writing outputs="
                outputs["humming"] = got
            else:
                outputs["humming"] = out
            fns["humming"] = hfn
        except Exception as exc:  # noqa: BLE001
            res["error"] = _err(exc)
            res["traceback"] = traceback.format_exc()
            _log(f"  humming {p.key} T={tokens} FAILED: {_err(exc)}")

    # Correctness: every output against the reference, on the checked experts' rows.
    try:
        if ref_aligned is None:
            from .triton_config import choose_config as _cc

            bm = _cc(rows_per_expert, p.n, p.k).block_m
            ref_aligned = (moe_align_block_size(topk_ids, bm, p.num_experts), bm)
        (sorted_ids, expert_ids, ntp), bm = ref_aligned
        experts, mask = check_subset(topk_ids, opts.check_routes)
        keep = torch.tensor(experts, dtype=expert_ids.dtype, device=dev)
        only = torch.where(torch.isin(expert_ids, keep), expert_ids, -1)
        t0 = time.perf_counter()
        want = moe_gemm_indexed_reference(x, words, scales, sorted_ids, only, ntp, p.top_k, bm)
        row.update(checked_experts=len(experts), checked_routes=int(mask.sum()),
                   reference_s=time.perf_counter() - t0)
        for name, got in outputs.items():
            ref = silu_and_mul_reference(want) if name == "chordq_fused" else want
            row[name].update(compare_rows(got, ref, mask))
            if not row[name]["ok"]:
                _log(f"  {name} {p.key} T={tokens}: cos_diff {row[name]['cos_diff']:.2e} "
                     f"above {MAX_COS_DIFF} (finite: {row[name]['finite']})")
        del want
    except Exception as exc:  # noqa: BLE001
        row["check_error"] = _err(exc)
        _log(f"  reference check {p.key} T={tokens} FAILED: {_err(exc)}")

    # Timing: graphs (interleaved A/B), then do_bench.
    for name, res in time_graphs(fns, opts.reps, opts.calls).items():
        row[name].update(res)
    if opts.do_bench:
        order = list(fns) if tokens % 2 == 0 else list(fns)[::-1]
        for name, res in time_do_bench({n: fns[n] for n in order}, opts.do_bench_warmup,
                                       opts.do_bench_rep).items():
            row[name].update(res)
    for name in CONTESTANTS:
        res = row.get(name)
        if isinstance(res, dict) and res.get("graph_us"):
            res["pct_of_floor"] = 100.0 * fl["floor_us"] / res["graph_us"]
    for key, field in (("ratio_graph", "graph_us"), ("ratio_do_bench", "do_bench_us")):
        a, b = row["chordq"].get(field), row["humming"].get(field)
        row[key] = a / b if a and b else None
    row["ratio_reps"] = ratio_reps(row["chordq"].get("graph_reps"),
                                   row["humming"].get("graph_reps"))
    if "chordq_alt" in row:
        a, b = row["chordq_alt"].get("graph_us"), row["chordq"].get("graph_us")
        row["ratio_alt"] = a / b if a and b else None
        row["ratio_alt_reps"] = ratio_reps(row["chordq_alt"].get("graph_reps"),
                                           row["chordq"].get("graph_reps"))
        row["alt_verdict"] = alt_verdict(row)
    return row


ALT_MARGIN = 0.01  # a median alt / chordq within 1% of 1.0 is "level", whatever the reps say


def alt_verdict(row: dict) -> str:
    """The call on a row's alt, decided before it is measured: "wins" where the median
    alt / chordq is at most ``1 - ALT_MARGIN`` and the alt was faster in every interleaved
    repetition, "loses" the mirror image, "wrong" where its output failed the reference check,
    else "level". Every rep on one side is a sign test: 6 reps of noise that favours neither
    all fall on the alt's side once in 64, where one process's median alone moved 4-9%
    between runs of the same config (performance.md §30)."""
    alt = row.get("chordq_alt")
    if not isinstance(alt, dict) or "error" in alt or alt.get("ok") is False:
        return "wrong"
    reps = row.get("ratio_alt_reps")
    if not reps:
        return "n/a"
    med = statistics.median(reps)
    if med <= 1 - ALT_MARGIN and max(reps) < 1:
        return "wins"
    if med >= 1 + ALT_MARGIN and min(reps) > 1:
        return "loses"
    return "level"


def ratio_reps(a: Sequence[float] | None, b: Sequence[float] | None) -> list[float] | None:
    """Each interleaved repetition's ratio ``a / b``: the two ran next to each other, so a
    clock that drifts across repetitions (long rows on a warming card: 10-15%, performance.md
    §25) moves both, where the medians of ``a`` and of ``b`` may pick different repetitions."""
    if not a or not b or len(a) != len(b):
        return None
    return [x / y for x, y in zip(a, b)]


# ------------------------------------------------------------------ report


def _f(v: Any, fmt: str = ".1f", missing: str = "n/a") -> str:
    return missing if v is None else format(v, fmt)


def _cos(res: dict) -> str:
    if "error" in res:
        return "err"
    if "cos_diff" not in res:
        return "n/a"
    return f"{res['cos_diff']:.1e}{'' if res.get('ok') else ' FAIL'}"


def render_markdown(rows: list[dict], meta: dict) -> str:
    hm = meta.get("humming", {})
    lines = [
        "# chordq vs humming-kernels: indexed W4A16 MoE GEMMs, same process, same inputs",
        "",
        f"{meta.get('date', '')} · {meta.get('gpu', '')} · torch {meta.get('torch', '')} · "
        f"triton {meta.get('triton', '')} · humming {hm.get('version', 'n/a')} "
        f"({hm.get('file', hm.get('error', 'not loaded'))})",
        "",
        f"Graph = CUDA-graph replay of {meta.get('calls')} calls, median of {meta.get('reps')} "
        "interleaved A/B repetitions (primary); do_bench = triton.testing.do_bench mean, L2 "
        f"flushed, warmup {meta.get('do_bench_warmup')} / rep {meta.get('do_bench_rep')} ms. "
        "ratio = chordq µs / Humming µs (< 1: chordq faster). Floor = max(bytes / 4.28 TB/s, "
        "FLOPs / 792 TFLOP/s), kernels.md §3 model at each layout's shape, with the experts the "
        "draw touched; % = floor / graph µs. per rep = each repetition's chordq / Humming "
        "graph time (measured next to each other; the median ratio of the two medians may "
        "pair different repetitions where the clock drifts).",
        "",
        "GEMM to GEMM: both gate_up columns write 8T x 2I (chordq with activation=None). "
        "'chordq fused' is chordq's shipped gate_up with SiLU-and-mul fused (writes 8T x I; "
        "Humming's vLLM path adds a separate silu_and_mul launch). cos = cos_diff vs "
        "chordq's PyTorch reference on the checked experts' rows. chordq's weights: "
        f"{meta.get('w_order', 'checkpoint')} (converted once, untimed, as Humming's "
        "transform()). Tiles: chordq BM,BN,BK,warps,stages (P planes / Q pairs / F fragments "
        "/ Z subnormal K order, S split-K, R register cap, L column tiles a program, K "
        "stream-K, G Gluon); Humming (block shape) mma x CTAs/SM "
        "(ws = warp-specialized, sk = stream-K).",
        "",
        "| layout | T | proj | experts | chordq tile | Humming tile | cos chordq / Humming "
        "| chordq graph µs | Humming graph µs | ratio graph | per rep | chordq do_bench µs "
        "| Humming do_bench µs | ratio do_bench | floor µs | chordq % floor | Humming % floor "
        "| chordq fused graph µs |",
        "|---|---:|---|---:|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c, h, fz = r.get("chordq", {}), r.get("humming", {}), r.get("chordq_fused", {})
        lines.append(
            f"| {r['layout']} | {r['tokens']} | {r['projection']} | {r['experts_touched']} "
            f"| {c.get('config', 'err')} | {h.get('config', 'n/a')} | {_cos(c)} / {_cos(h)} "
            f"| {_f(c.get('graph_us'))} | {_f(h.get('graph_us'))} "
            f"| {_f(r.get('ratio_graph'), '.2f')} "
            f"| {'/'.join(f'{v:.2f}' for v in r.get('ratio_reps') or []) or 'n/a'} "
            f"| {_f(c.get('do_bench_us'))} | {_f(h.get('do_bench_us'))} "
            f"| {_f(r.get('ratio_do_bench'), '.2f')} "
            f"| {r['floor_us']:.1f} ({r['bound'][:3]}) | {_f(c.get('pct_of_floor'), '.0f')}% "
            f"| {_f(h.get('pct_of_floor'), '.0f')}% "
            f"| {_f(fz.get('graph_us'), '.1f', '-' if r['projection'] != 'gate_up' else 'n/a')} |")
    sums: dict[tuple[str, int], dict[str, float]] = {}
    for r in rows:
        s = sums.setdefault((r["layout"], r["tokens"]), {"chordq": 0.0, "humming": 0.0, "n": 0})
        c, h = r.get("chordq", {}).get("graph_us"), r.get("humming", {}).get("graph_us")
        s["chordq"] += c or math.nan
        s["humming"] += h or math.nan
        s["n"] += 1
    lines += ["", "gate_up + down, graph µs (chordq / Humming / ratio):", ""]
    for (layout, t), s in sums.items():
        if s["n"] == 2:
            ratio = s["chordq"] / s["humming"] if s["humming"] else math.nan
            lines.append(f"- {layout} T={t}: {s['chordq']:.1f} / {s['humming']:.1f} / {ratio:.2f}")
    alts = [r for r in rows if "chordq_alt" in r]
    if alts:
        head = (f"chordq alt ({meta.get('alt')}) / chordq, same process, graph µs (tiles, "
                "alt µs / chordq µs, ratio, per rep):")
        lines += ["", head, ""]
        for r in alts:
            a, c = r["chordq_alt"], r["chordq"]
            lines.append(
                f"- {r['layout']} T={r['tokens']} {r['projection']}: {a.get('config', 'err')} "
                f"vs {c.get('config', 'err')}, {_f(a.get('graph_us'))} / "
                f"{_f(c.get('graph_us'))}, {_f(r.get('ratio_alt'), '.3f')}, "
                f"{'/'.join(f'{v:.3f}' for v in r.get('ratio_alt_reps') or []) or 'n/a'}"
                f" (cos {_cos(a)}): alt {r.get('alt_verdict', 'n/a')}")
        tally = collections.Counter(r.get("alt_verdict", "n/a") for r in alts)
        lines += ["", "alt verdicts (median beyond ±{:.0%} and every rep on one side): {}".format(
            ALT_MARGIN, ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))]
    errors = [f"- {r['layout']} T={r['tokens']} {r['projection']} {name}: {r[name]['error']}"
              for r in rows for name in CONTESTANTS
              if isinstance(r.get(name), dict) and "error" in r[name]
              and r[name]["error"] != "not requested"]
    errors += [f"- {r['layout']} T={r['tokens']} {r['projection']} reference: {r['check_error']}"
               for r in rows if "check_error" in r]
    if hm.get("error"):
        errors.insert(0, f"- humming import/install: {hm['error']}")
    for key, info in meta.get("humming_layers", {}).items():
        if "error" in info:
            errors.append(f"- humming layer {key}: {info['error']}")
    if errors:
        lines += ["", "Failures:", "", *errors]
    layers = meta.get("humming_layers", {})
    if layers:
        lines += ["", "Humming layers: " + ", ".join(
            f"{k} b_dtype={v.get('b_dtype', 'n/a')}" for k, v in layers.items())]
    if meta.get("skipped"):
        lines += ["", f"Skipped (time budget): {', '.join(meta['skipped'])}"]
    lines += ["", f"GPU state before: {meta.get('gpu_state_before', '')}", "",
              f"GPU state after: {meta.get('gpu_state_after', 'run not finished')}", ""]
    return "\n".join(lines)


def _write(out_dir: Path | None, rows: list[dict], meta: dict) -> str:
    table = render_markdown(rows, meta)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench_humming.md").write_text(table)
        clean = [{k: ({kk: vv for kk, vv in v.items() if kk != "traceback"}
                      if isinstance(v, dict) else v) for k, v in r.items()} for r in rows]
        (out_dir / "bench_humming.json").write_text(
            json.dumps({"meta": meta, "rows": clean, "tracebacks": [
                {"layout": r["layout"], "tokens": r["tokens"], "projection": r["projection"],
                 "who": name, "traceback": r[name]["traceback"]}
                for r in rows for name in CONTESTANTS
                if isinstance(r.get(name), dict) and "traceback" in r[name]]},
                indent=2, default=str))
    return table


def _row_line(r: dict) -> str:
    c, h = r.get("chordq", {}), r.get("humming", {})
    fused = r.get("chordq_fused", {}).get("graph_us")
    return (f"{r['layout']} T={r['tokens']:5d} {r['projection']:8s} "
            f"chordq {_f(c.get('graph_us'), '8.1f')} µs ({_f(c.get('pct_of_floor'), '.0f')}%) "
            f"cos {_cos(c)} | humming {_f(h.get('graph_us'), '8.1f')} µs "
            f"({_f(h.get('pct_of_floor'), '.0f')}%) cos {_cos(h)} | "
            f"ratio {_f(r.get('ratio_graph'), '.2f')}"
            + (f" | chordq fused {fused:.1f} µs" if fused else "")
            + (f" | alt / chordq {_f(r.get('ratio_alt'), '.3f')} ({r.get('alt_verdict')})"
               if "chordq_alt" in r else "")
            + f" | floor {r['floor_us']:.1f} µs")


def run_comparison(
    tokens: Sequence[int] = DEFAULT_TOKENS,
    layouts: Sequence[str] = ("EP8",),
    humming_wheel: str | None = None,
    against_humming: bool = True,
    out_dir: str | Path | None = None,
    opts: Options | None = None,
    max_minutes: float | None = None,
    humming_target: str | None = None,
    device: str = "cuda",
) -> dict[str, Any]:
    """Run the side-by-side benchmark; returns ``{"meta": ..., "rows": [...]}``.

    :param humming_wheel: wheel / folder for :func:`install_humming`; None imports an installed
        humming
    :param max_minutes: start no new (layout, T) after this many minutes (rows done are kept)
    :param device: "cuda" (anything else only for tests, with the timing functions replaced)
    :raises RuntimeError: without a CUDA device
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the humming comparison needs a CUDA GPU (none found)")
    import triton

    from .bench import _gpu_state

    opts = opts or Options()
    start = time.perf_counter()
    out = Path(out_dir) if out_dir is not None else None
    meta: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "triton": triton.__version__, "tokens": list(tokens), "layouts": list(layouts),
        **dataclasses.asdict(opts), "gpu_state_before": _gpu_state(), "humming": {},
        "humming_layers": {}, "skipped": [], "argv": sys.argv,
    }
    _log(f"GPU: {meta['gpu_state_before']}")

    hm_ok = False
    if against_humming:
        try:
            root = install_humming(humming_wheel, humming_target) if humming_wheel else None
            _, info = import_humming(root)
            meta["humming"] = info
            hm_ok = True
            _log(f"humming {info['version']} from {info['file']}")
        except Exception as exc:  # noqa: BLE001
            meta["humming"] = {"error": _err(exc), "traceback": traceback.format_exc()}
            _log(f"HUMMING UNAVAILABLE ({_err(exc)}): continuing with chordq-only numbers")
    else:
        meta["humming"] = {"error": "not requested"}

    rows: list[dict] = []
    for li, layout in enumerate(layouts):
        problems = LAYOUTS[layout]
        weights, layers, chordq_weights = {}, {}, {}
        for pi, p in enumerate(problems):
            weights[p] = make_weights(p, opts.seed * 100 + 10 * li + pi, device)
            chordq_weights[p] = convert_weights(*weights[p], opts.w_order)
            lv = levels_present(weights[p][0])
            _log(f"{p.key}: words {tuple(weights[p][0].shape)}, {lv} code levels present")
            if not against_humming:
                layers[p] = None
            elif not hm_ok:
                layers[p] = {"error": f"humming unavailable: {meta['humming'].get('error')}"}
            else:
                try:
                    if lv != 16:
                        raise RuntimeError(f"only {lv} code levels in the weights; Humming could "
                                           "take its float4e0m3 path")
                    layer, info = build_humming_layer(p, *weights[p])
                    layers[p] = {"layer": layer, "cfg_cache": {}}
                    meta["humming_layers"][p.key] = info
                except Exception as exc:  # noqa: BLE001
                    layers[p] = {"error": _err(exc)}
                    meta["humming_layers"][p.key] = {"error": _err(exc),
                                                     "traceback": traceback.format_exc()}
                    _log(f"humming layer {p.key} FAILED: {_err(exc)}")
        for t in tokens:
            if max_minutes is not None and time.perf_counter() - start > 60 * max_minutes:
                meta["skipped"].append(f"{layout} T={t}")
                _log(f"time budget of {max_minutes} min spent: skipping {layout} T={t}")
                continue
            topk_ids = draw_routing(t, problems[0].num_experts, TOP_K,
                                    routing_seed(opts.seed, layout, t)).to(device)
            for p in problems:
                try:
                    row = bench_shape(p, t, topk_ids, *weights[p], layers[p], opts,
                                      chordq_weights[p])
                except Exception as exc:  # noqa: BLE001 - keep going with the next shape
                    row = {"layout": layout, "tokens": t, "projection": p.proj,
                           "experts_touched": 0, **floor_model(p, t, 0),
                           "chordq": {"error": _err(exc), "traceback": traceback.format_exc()},
                           "humming": {"error": "shape failed"}}
                    _log(f"{p.key} T={t} FAILED: {_err(exc)}")
                rows.append(row)
                _log(_row_line(row))
                _write(out, rows, meta)
        del weights, layers, chordq_weights
        if device == "cuda":
            torch.cuda.empty_cache()
    meta["gpu_state_after"] = _gpu_state()
    meta["wall_s"] = time.perf_counter() - start
    table = _write(out, rows, meta)
    _log(table)
    return {"meta": meta, "rows": rows}


def exit_status(result: dict) -> int:
    """0: all checked and compared; 1: some output failed its cos_diff check; 2: the Humming
    comparison did not run for some row (chordq numbers are still there)."""
    rows = result["rows"]
    if any(isinstance(r.get(n), dict) and r[n].get("ok") is False
           for r in rows for n in CONTESTANTS):
        return 1
    if any("error" in r.get("chordq", {}) or "check_error" in r for r in rows):
        return 1
    if any("error" in r.get("humming", {}) or "graph_us" not in r.get("humming", {})
           for r in rows):
        return 2
    return 0
