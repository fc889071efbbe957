"""Benchmark `chordq convert` on a synthetic checkpoint with real Kimi K2 expert shapes.

Builds an FP8-block checkpoint (7168x2048 experts with 128x128 block scales, K2 tensor names),
then measures, in the same run:
  * the I/O floor: reading every source shard and writing the output's bytes with plain file
    copies (read + write + fsync, same files, same page cache state);
  * `chordq convert` with --method rtn and --method mse (each in a fresh process, peak RSS from
    that process);
  * a straightforward per-tensor PyTorch RTN converter (safetensors load, torch dequant, torch
    quantize, torch pack, save_file per shard) as the peer;
and prints MB/s of source, the ratio to the floor, the speedup over the peer, peak RSS, and the
projected time for a full Kimi K2 (1.03 TB of FP8 source).

    python scripts/bench_convert.py --layers 2 --experts 8 --device cpu --out /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_kimi import TINY_TEXT_CONFIG, fp8_block_quantize  # noqa: E402

K2_FP8_BYTES = 1.03e12  # full Kimi K2 FP8 checkpoint
H, I = 7168, 2048


def build_checkpoint(root: Path, layers: int, experts: int, experts_per_shard: int) -> Path:
    """FP8 K2-shaped MoE layers (layer 0 is a small dense stand-in, as in K2)."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY_TEXT_CONFIG)
    cfg.update(hidden_size=H, moe_intermediate_size=I, intermediate_size=256, num_hidden_layers=layers + 1,
               n_routed_experts=experts, num_experts_per_tok=min(8, experts), vocab_size=256,
               quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [128, 128]})
    g = torch.Generator().manual_seed(0)
    weight_map, shard, files = {}, {}, []

    def flush() -> None:
        if shard:
            files.append(f"model-{len(files) + 1:05d}.safetensors")
            save_file(shard, str(root / files[-1]), metadata={"format": "pt"})
            weight_map.update({k: files[-1] for k in shard})
            shard.clear()

    shard["model.embed_tokens.weight"] = torch.randn(256, H, generator=g).to(torch.bfloat16)
    for p in ("gate_proj", "up_proj", "down_proj"):
        shape = (H, 256) if p == "down_proj" else (256, H)
        shard[f"model.layers.0.mlp.{p}.weight"] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    flush()
    for layer in range(1, layers + 1):
        shard[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(experts, H, generator=g).to(torch.bfloat16)
        shard[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = torch.zeros(experts)
        for e in range(experts):
            for p in ("gate_proj", "up_proj", "down_proj"):
                shape = (H, I) if p == "down_proj" else (I, H)
                w = torch.randn(shape, generator=g) * 0.02
                q, s = fp8_block_quantize(w)
                shard[f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"] = q
                shard[f"model.layers.{layer}.mlp.experts.{e}.{p}.weight_scale_inv"] = s
            if (e + 1) % experts_per_shard == 0:
                flush()
        flush()
    shard["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    shard["lm_head.weight"] = torch.randn(256, H, generator=g).to(torch.bfloat16)
    flush()
    total = sum((root / f).stat().st_size for f in files)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    return root


def io_floor(src: Path, out_bytes: int, scratch: Path) -> float:
    """Seconds to read every source shard and write ``out_bytes`` with plain file I/O."""
    scratch.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("*.safetensors"))
    share = out_bytes // max(1, len(shards))
    t0 = time.perf_counter()
    for i, f in enumerate(shards):
        data = f.read_bytes()
        with open(scratch / f"copy{i}", "wb") as o:
            o.write(data[:share] if len(data) >= share else data + bytes(share - len(data)))
            o.flush()
            os.fsync(o.fileno())
    dt = time.perf_counter() - t0
    shutil.rmtree(scratch)
    return dt


def chordq_run(src: Path, out: Path, method: str, device: str, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "chordq", "convert", str(src), "-o", str(out), "--method", method,
           "--device", device, "--workers", str(workers), "--json"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"chordq convert failed: {r.stderr}")
    res = json.loads(r.stdout)
    res["wall_s"] = wall
    return res


NAIVE = r'''
import json, sys, time, resource, torch
from pathlib import Path
from safetensors import safe_open
from safetensors.torch import save_file
src, out = Path(sys.argv[1]), Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
t0 = time.perf_counter()
for file in sorted(set(index.values())):
    tensors = {}
    with safe_open(str(src / file), "pt") as f:
        for name in f.keys():
            if name.endswith("weight_scale_inv"):
                continue
            t = f.get_tensor(name)
            if ".experts." not in name:
                tensors[name] = t
                continue
            sname = name[:-len("weight")] + "weight_scale_inv"
            with safe_open(str(src / index[sname]), "pt") as g:
                s = g.get_tensor(sname)
            w = t.float() * s.repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[:, : t.shape[1]]
            n, k = w.shape
            grp = w.reshape(n, k // 32, 32)
            scale = (grp.abs().amax(-1) / 7.5).to(torch.bfloat16)
            q = torch.clamp(torch.round(grp / scale.float()[..., None]), -8, 7).to(torch.int32) + 8
            q = q.reshape(n, k // 8, 8) << (torch.arange(8, dtype=torch.int32) * 4)
            p = name[:-len("weight")]
            tensors[p + "weight_packed"] = q.sum(-1, dtype=torch.int32)
            tensors[p + "weight_scale"] = scale
            tensors[p + "weight_shape"] = torch.tensor([n, k])
    save_file(tensors, str(out / file))
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
'''


def naive_run(src: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    r = subprocess.run([sys.executable, "-c", NAIVE, str(src), str(out)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"naive converter failed: {r.stderr}")
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--experts-per-shard", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/chordq-bench"))
    ap.add_argument("--out", type=Path, default=None, help="write bench_convert.{md,json} here")
    ap.add_argument("--no-naive", action="store_true", help="skip the per-tensor torch peer")
    ap.add_argument("--extra-workers", type=int, default=0, help="also time rtn with this many workers")
    a = ap.parse_args()
    src = a.work / "src"
    if not (src / "config.json").exists():
        print(f"building synthetic K2 FP8 checkpoint: {a.layers} MoE layers x {a.experts} experts ...", flush=True)
        build_checkpoint(src, a.layers, a.experts, a.experts_per_shard)
    src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    for f in src.glob("*.safetensors"):  # warm the page cache once, equally for everyone
        f.read_bytes()
    # Warm-up: one tiny conversion per method fills Triton's / numba's on-disk compile caches,
    # so the timed runs measure steady-state conversion, not one-off JIT compilation.
    from make_tiny_kimi import make_tiny_kimi

    tiny = make_tiny_kimi(a.work / "tiny", "fp8")
    for m in ("rtn", "mse"):
        chordq_run(tiny, a.work / "tiny-out", m, a.device, 1)
    rows = []
    runs = {m: chordq_run(src, a.work / f"out-{m}", m, a.device, a.workers) for m in ("rtn", "mse")}
    if a.extra_workers:
        runs[f"rtn, {a.extra_workers} workers"] = chordq_run(src, a.work / "out-w", "rtn", a.device, a.extra_workers)
    out_bytes = sum(f.stat().st_size for f in (a.work / "out-rtn").glob("*.safetensors"))
    floor_s = io_floor(src, out_bytes, a.work / "floor")
    floor_mbs = src_bytes / floor_s / 1e6
    naive = None if a.no_naive else naive_run(src, a.work / "out-naive")
    for m, r in runs.items():
        mbs = src_bytes / r["seconds"] / 1e6
        rows.append({
            "method": m, "device": ",".join(sorted(set(r["devices"]))), "workers": r["workers"],
            "source_GB": src_bytes / 1e9, "seconds": r["seconds"], "MB_s": mbs, "floor_MB_s": floor_mbs,
            "pct_of_floor": 100 * mbs / floor_mbs, "peak_rss_GB": r["peak_rss_bytes"] / 1e9,
            "sqnr_mean_db": r["sqnr_mean_db"], "full_k2_hours": K2_FP8_BYTES / (mbs * 1e6) / 3600,
            "vs_naive_rtn": (naive["seconds"] / r["seconds"]) if naive else None,
        })
    lines = [
        f"source {src_bytes / 1e9:.2f} GB FP8 ({a.layers} layers x {a.experts} experts of 7168x2048), "
        f"output {out_bytes / 1e9:.2f} GB; I/O floor {floor_s:.2f} s = {floor_mbs:.0f} MB/s"
        + (f"; naive torch RTN {naive['seconds']:.2f} s = {src_bytes / naive['seconds'] / 1e6:.0f} MB/s, "
           f"peak RSS {naive['peak_rss_bytes'] / 1e9:.2f} GB" if naive else ""),
        "",
        "| method | device | workers | MB/s | % of I/O floor | x naive torch RTN | peak RSS GB | mean SQNR dB | full K2 (1.03 TB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        vs = f"{r['vs_naive_rtn']:.2f}" if r["vs_naive_rtn"] else "-"
        lines.append(f"| {r['method']} | {r['device']} | {r['workers']} | {r['MB_s']:.0f} | {r['pct_of_floor']:.0f}% | {vs} | "
                     f"{r['peak_rss_GB']:.2f} | {r['sqnr_mean_db']:.2f} | {r['full_k2_hours']:.2f} h |")
    mse_rtn = runs["mse"]["seconds"] / runs["rtn"]["seconds"]
    lines.append("\n(MB/s = source bytes / conversion time inside the process: CUDA or numba start-up included, "
                 "compilation warmed up; page cache warm for every run and for the floor.)")
    lines.append(f"\nmse / rtn time: {mse_rtn:.2f}x")
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bench_convert.md").write_text(text + "\n")
        (a.out / "bench_convert.json").write_text(json.dumps({"rows": rows, "floor_s": floor_s, "naive": naive,
                                                               "mse_over_rtn": mse_rtn}, indent=2))


if __name__ == "__main__":
    main()
