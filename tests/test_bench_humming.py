"""CPU tests of the chordq-vs-Humming benchmark (chordq.kernels.bench_humming): the floor model,
routing and alignment helpers, the report, the wrapper script's flags, and one end-to-end run on
tiny shapes against a fake ``humming`` package (chordq's kernels interpreted, timing faked).
No GPU and no real humming needed; the real wheel is only installed (not imported) if present.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from chordq.kernels import bench_humming as bh  # noqa: E402
from chordq.kernels.align import moe_align_block_size  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EP8_GATE_UP, EP8_DOWN = bh.LAYOUTS["EP8"]


# ------------------------------------------------------------------ floor model (kernels.md §3)

# T: (gate_up floor µs, down floor µs) from kernels.md's table (expected touched experts).
DOC_FLOORS = {1: (30.9, 15.5), 8: (142, 71.3), 20: (181, 90.8), 32: (185, 93.4),
              128: (187, 96.9), 512: (304, 152), 2048: (1215, 607), 8192: (4859, 2430)}


@pytest.mark.parametrize("tokens", sorted(DOC_FLOORS))
def test_floor_model_matches_kernels_md(tokens):
    touched = bh.expected_touched(48, tokens)
    for p, want in zip((EP8_GATE_UP, EP8_DOWN), DOC_FLOORS[tokens]):
        got = bh.floor_model(p, tokens, touched)["floor_us"]
        assert got == pytest.approx(want, rel=0.012), (p.proj, tokens)


def test_floor_model_bound_and_datasheet():
    assert bh.floor_model(EP8_GATE_UP, 20, 46.7)["bound"] == "memory"
    big = bh.floor_model(EP8_GATE_UP, 2048, 48)
    assert big["bound"] == "compute"
    assert big["datasheet_floor_us"] == pytest.approx(973, rel=0.01)  # kernels.md: [973]
    assert big["flops"] == 2 * 8 * 2048 * 4096 * 7168


def test_floor_model_tp8_is_the_same_model():
    gate_up, down = bh.LAYOUTS["TP8"]
    assert (gate_up.num_experts, gate_up.n, gate_up.k) == (384, 512, 7168)
    assert (down.num_experts, down.n, down.k) == (384, 7168, 256)
    f = bh.floor_model(gate_up, 1, 8)
    weight = 8 * (512 * 7168 // 2 + 512 * 224 * 2)
    assert f["bytes"] == weight + 7168 * 2 + 8 * 512 * 2
    assert f["floor_us"] == pytest.approx(f["bytes"] / 4.28e12 * 1e6)
    assert bh.floor_model(down, 8192, 384)["bound"] == "memory"  # K=256: little work per byte


def test_expected_touched():
    assert bh.expected_touched(48, 1) == pytest.approx(8.0)
    assert bh.expected_touched(48, 20) == pytest.approx(48 * (1 - (5 / 6) ** 20))
    assert bh.expected_touched(384, 8192) == pytest.approx(384)


# ------------------------------------------------------------------ routing, alignment, subsets


def test_draw_routing_uniform_distinct_and_seeded():
    ids = bh.draw_routing(64, 48, 8, seed=3)
    assert ids.dtype == torch.int32 and ids.shape == (64, 8)
    assert int(ids.min()) >= 0 and int(ids.max()) < 48
    assert all(len(set(r)) == 8 for r in ids.tolist())
    assert torch.equal(ids, bh.draw_routing(64, 48, 8, seed=3))
    assert not torch.equal(ids, bh.draw_routing(64, 48, 8, seed=4))
    seeds = {bh.routing_seed(0, lay, t) for lay in ("EP8", "TP8") for t in bh.DEFAULT_TOKENS}
    assert len(seeds) == 2 * len(bh.DEFAULT_TOKENS)


def test_one_draw_aligned_to_two_block_sizes_routes_the_same_rows():
    ids = bh.draw_routing(20, 48, 8, seed=1)
    routes = {}
    for bm in (8, 16, 96):
        s, e, ntp = moe_align_block_size(ids, bm, 48)
        n = int(ntp[0])
        assert n % bm == 0
        sid, exp = s[:n].long(), e[: n // bm].long().repeat_interleave(bm)
        valid = sid < 160
        routes[bm] = sorted(zip(sid[valid].tolist(), exp[valid].tolist()))
    want = sorted((r, int(x)) for r, x in enumerate(ids.reshape(-1).tolist()))
    assert routes[8] == routes[16] == routes[96] == want


def test_check_subset():
    ids = bh.draw_routing(20, 48, 8, seed=2)  # 160 routes
    experts, mask = bh.check_subset(ids, 10_000)
    assert experts == sorted(set(ids.reshape(-1).tolist())) and bool(mask.all())
    experts, mask = bh.check_subset(ids, 20)
    flat = ids.reshape(-1)
    assert max(flat.tolist()) in experts and min(flat.tolist()) in experts  # both ends
    assert int(mask.sum()) >= 20 and int(mask.sum()) < 160
    assert torch.equal(mask, torch.isin(flat, torch.tensor(experts, dtype=flat.dtype)))
    assert len(bh.check_subset(ids, 0)[0]) == 1


def test_pick_interval_uses_lo_exclusive_hi_inclusive():
    cfgs = [[0, 8, {"block_shape": [8]}], [8, 96, {"block_shape": [16]}],
            [96, 1 << 30, {"block_shape": [96]}]]
    assert bh.pick_interval(cfgs, 1)["block_shape"] == [8]
    assert bh.pick_interval(cfgs, 8)["block_shape"] == [8]
    assert bh.pick_interval(cfgs, 9)["block_shape"] == [16]
    assert bh.pick_interval(cfgs, 65536)["block_shape"] == [96]
    with pytest.raises(ValueError):
        bh.pick_interval(cfgs[1:], 3)


def test_interleave_order():
    assert bh.interleave_order(["a", "b"], 3) == ["a", "b", "b", "a", "a", "b"]
    order = bh.interleave_order(["a", "b", "c"], 4)
    assert all(order.count(n) == 4 for n in "abc")


def test_make_weights_all_levels_and_seeded():
    p = bh.Problem("X", "down", 3, 16, 64)
    w, s = bh.make_weights(p, 7, "cpu")
    assert w.dtype == torch.int32 and w.shape == (3, 16, 8)
    assert s.dtype == torch.bfloat16 and s.shape == (3, 16, 2)
    assert bh.levels_present(w) == 16
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    for e in range(3):
        codes = ((w[e, 0, :2].unsqueeze(-1) >> shifts) & 0xF).reshape(-1)
        assert codes.tolist() == list(range(16))
    assert torch.equal(w, bh.make_weights(p, 7, "cpu")[0])


def test_compare_rows():
    want = torch.randn(6, 32).to(torch.bfloat16)
    mask = torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.bool)
    got = want.clone()
    got[2] = float("nan")  # an unchecked row
    res = bh.compare_rows(got, want, mask)
    assert res["ok"] and res["cos_diff"] == pytest.approx(0.0, abs=1e-12)
    got[0] = -got[0]
    assert not bh.compare_rows(got, want, mask)["ok"]


# ------------------------------------------------------------------ report and exit status


def _fake_row(**humming):
    row = {"layout": "EP8", "tokens": 20, "projection": "gate_up", "experts_touched": 47,
           **bh.floor_model(EP8_GATE_UP, 20, 47),
           "chordq": {"config": "16,128,128,4,4,P", "cos_diff": 3e-8, "ok": True,
                      "graph_us": 400.0, "do_bench_us": 410.0, "pct_of_floor": 45.0},
           "chordq_fused": {"graph_us": 420.0, "ok": True, "cos_diff": 1e-8},
           "humming": humming, "ratio_graph": None, "ratio_do_bench": None}
    if "graph_us" in humming:
        row["ratio_graph"] = 400.0 / humming["graph_us"]
    return row


def test_render_markdown_and_exit_status():
    ok = _fake_row(config="(8,128,64) mma x4 sk", cos_diff=2e-6, ok=True, graph_us=200.0,
                   do_bench_us=210.0, pct_of_floor=90.0)
    down = dict(_fake_row(config="(8,256,128) wgmma x2", cos_diff=2e-6, ok=True, graph_us=100.0),
                projection="down")
    down.pop("chordq_fused")
    meta = {"calls": 20, "reps": 3, "humming": {"version": "0.1.19", "file": "/x/humming"},
            "humming_layers": {"EP8/gate_up": {"b_dtype": "uint4"}}}
    md = bh.render_markdown([ok, down], meta)
    assert "| EP8 | 20 | gate_up | 47 |" in md and "| 2.00 |" in md
    assert "EP8 T=20: 800.0 / 300.0 / 2.67" in md
    assert "b_dtype=uint4" in md and "Failures" not in md
    json.dumps({"rows": [ok, down]})
    assert bh.exit_status({"rows": [ok, down]}) == 0

    failed = _fake_row(error="RuntimeError: Humming b_dtype is float4e0m3, not uint4")
    md = bh.render_markdown([failed], {"humming": {"error": "ImportError: nope"}})
    assert "n/a" in md and "float4e0m3" in md and "ImportError: nope" in md
    assert bh.exit_status({"rows": [failed]}) == 2
    bad = _fake_row(config="x", cos_diff=0.5, ok=False, graph_us=1.0)
    assert "FAIL" in bh.render_markdown([bad], {})
    assert bh.exit_status({"rows": [bad]}) == 1


# ------------------------------------------------------------------ the wrapper script


def _script():
    spec = importlib.util.spec_from_file_location("bench_kernels_script",
                                                  REPO / "scripts" / "bench_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_script_flags():
    script = _script()
    args = script.build_parser().parse_args(
        ["--against", "humming", "--humming-wheel", "w.whl", "--layouts", "EP8", "TP8",
         "--tokens", "1", "20", "--reps", "5", "--no-do-bench", "--max-minutes", "7"])
    assert args.against == "humming" and args.layouts == ["EP8", "TP8"]
    assert args.tokens == [1, 20] and args.reps == 5 and args.no_do_bench
    assert args.max_minutes == 7.0 and args.check_routes == 2048
    with pytest.raises(SystemExit):
        script.build_parser().parse_args(["--against", "chord"])
    assert script.main(["--humming-wheel", "w.whl"]) == 2  # needs --against humming
    if not torch.cuda.is_available():
        assert script.main(["--against", "humming", "--humming-wheel", "w.whl"]) == 0


# ------------------------------------------------------------------ installing humming


def test_install_humming_unzip_keeps_modes_and_accepts_folders(tmp_path):
    whl = tmp_path / "humming_kernels-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("humming/__init__.py", "__version__ = '0.0.1'\n")
        info = zipfile.ZipInfo("humming/bin/tool")
        info.external_attr = (0o755 | stat.S_IFREG) << 16
        z.writestr(info, "#!/bin/sh\n")
    dest = bh.install_humming(whl, tmp_path / "t", use_pip=False, log=lambda m: None)
    assert (dest / "humming" / "__init__.py").exists()
    assert os.access(dest / "humming" / "bin" / "tool", os.X_OK)
    assert bh.install_humming(dest, log=lambda m: None) == dest  # a --target folder
    assert bh.install_humming(dest / "humming", log=lambda m: None) == dest  # humming/ itself
    with pytest.raises(FileNotFoundError):
        bh.install_humming(tmp_path / "missing.whl", log=lambda m: None)


def test_install_real_wheel_with_pip(tmp_path):
    wheels = sorted((REPO / ".whl").glob(bh.WHEEL_GLOB))
    if not wheels:
        pytest.skip("no humming wheel in .whl/")
    dest = bh.install_humming(REPO / ".whl", tmp_path / "t", log=lambda m: None)  # the folder
    assert (dest / "humming" / "layer.py").exists()
    assert (dest / "humming" / "testing" / "data.py").exists()
    assert (dest / "humming" / "tune" / "__init__.py").exists()


# ------------------------------------------------------------------ end to end, fake humming

FAKE_LAYER = '''
import json
import torch
from chordq.kernels.reference import moe_gemm_indexed_reference

class _DType:
    def __init__(self, name):
        self.dtype_str = name

class _Config:
    def __init__(self, b_dtype):
        self.b_dtype = _DType(b_dtype)

class HummingLayer(torch.nn.Module):
    calls = []

    def __init__(self, shape_n, shape_k, num_experts, weight_config, torch_dtype):
        super().__init__()
        assert weight_config["dtype"] == "uint4" and weight_config["group_size"] == 32
        self.weight = torch.nn.Parameter(torch.zeros(num_experts, shape_n, shape_k // 8,
                                                     dtype=torch.int32), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.zeros(num_experts, shape_n, shape_k // 32,
                                                           dtype=torch.bfloat16),
                                               requires_grad=False)
        self.humming_config = None

    def load_from_tensors(self, tensors):
        self.load_state_dict(tensors, strict=False)

    def transform(self):
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        has_zero = bool((((self.weight.unsqueeze(-1) >> shifts) & 0xF) == 0).any())
        self.humming_config = _Config("uint4" if has_zero else "float4e0m3")

    def forward(self, inputs, outputs=None, sorted_ids=None, expert_ids=None,
                num_tokens_padded=None, top_k=1, compute_config=None, tuning_config=None):
        assert json.loads(compute_config) == {"gemm_type": "indexed"}
        block_m = json.loads(tuning_config)["block_shape"][0]
        HummingLayer.calls.append((inputs.shape[0], top_k, block_m))
        ref = moe_gemm_indexed_reference(inputs, self.weight, self.weight_scale, sorted_ids,
                                         expert_ids, num_tokens_padded.reshape(1), top_k, block_m)
        outputs.copy_(ref)
        return outputs
'''

FAKE_TUNE = '''
def get_heuristics_config(layer_config, shape_m=None, gemm_type="dense", **kwargs):
    assert gemm_type == "indexed"
    return [[0, 16, {"block_shape": [8, 128, 64], "mma_type": "mma", "num_ctas_per_sm": 4,
                     "use_stream_k": True}],
            [16, 1 << 30, {"block_shape": [16, 256, 64], "mma_type": "wgmma",
                           "num_ctas_per_sm": 2}]]
'''

FAKE_DATA = '''
from chordq.kernels.align import moe_align_block_size

def generate_moe_tensors(topk_ids, num_experts, gemm_type, block_size_config=None):
    assert gemm_type == "indexed"
    s, e, ntp = moe_align_block_size(topk_ids, block_size_config, num_experts)
    return topk_ids, None, s, e, ntp.reshape(())
'''


@pytest.fixture
def fake_humming(tmp_path):
    root = tmp_path / "fake"
    for rel, text in {"humming/__init__.py": "__version__ = '0.1.19'\n",
                      "humming/layer.py": FAKE_LAYER, "humming/tune/__init__.py": FAKE_TUNE,
                      "humming/testing/__init__.py": "", "humming/testing/data.py": FAKE_DATA
                      }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    yield root
    for m in [m for m in sys.modules if m == "humming" or m.startswith("humming.")]:
        del sys.modules[m]
    while str(root) in sys.path:
        sys.path.remove(str(root))


def test_end_to_end_on_tiny_shapes_with_fake_humming(fake_humming, tmp_path, monkeypatch):
    # the smallest shapes with whole row blocks (N % 128, K % 256), as the default w_order needs
    tiny = (bh.Problem("EP8", "gate_up", 12, 128, 256), bh.Problem("EP8", "down", 12, 256, 256))
    monkeypatch.setitem(bh.LAYOUTS, "EP8", tiny)
    timings = {"chordq": 40.0, "chordq_fused": 44.0, "humming": 20.0}
    monkeypatch.setattr(bh, "time_graphs", lambda fns, reps, calls: {
        n: {"graph_us": timings[n], "graph_reps": [timings[n]] * reps} for n in fns})
    monkeypatch.setattr(bh, "time_do_bench", lambda fns, warmup, rep: {
        n: {"do_bench_us": timings[n] + 5} for n in fns})
    out = tmp_path / "out"
    result = bh.run_comparison((1, 3), ("EP8",), humming_wheel=str(fake_humming), out_dir=out,
                               opts=bh.Options(check_routes=8), device="cpu")
    rows = result["rows"]
    assert [(r["tokens"], r["projection"]) for r in rows] == [
        (1, "gate_up"), (1, "down"), (3, "gate_up"), (3, "down")]
    for r in rows:
        assert r["chordq"]["ok"] and r["humming"]["ok"], r
        assert r["chordq"]["cos_diff"] < 1e-6 and r["humming"]["cos_diff"] < 1e-6
        assert r["ratio_graph"] == pytest.approx(2.0)
        assert r["ratio_reps"] == pytest.approx([2.0] * 6)  # Options' even default
        assert r["humming"]["block_m"] == (8 if 8 * r["tokens"] <= 16 else 16)
        assert r["checked_routes"] >= min(8, 8 * r["tokens"])
        assert ("chordq_fused" in r) == (r["projection"] == "gate_up")
    assert rows[0]["chordq_fused"]["ok"]
    calls = sys.modules["humming.layer"].HummingLayer.calls
    assert (1, 8, 8) in calls and (8, 1, 8) in calls  # gate_up top_k 8, down [8T, K] top_k 1
    assert result["meta"]["humming_layers"]["EP8/gate_up"]["b_dtype"] == "uint4"
    assert bh.exit_status(result) == 0
    assert result["meta"]["w_order"] == "blocked"
    saved = json.loads((out / "bench_humming.json").read_text())
    assert len(saved["rows"]) == 4
    assert "| EP8 | 3 | down |" in (out / "bench_humming.md").read_text()


def test_build_layer_refuses_float4e0m3(fake_humming):
    bh.import_humming(fake_humming, log=lambda m: None)
    p = bh.Problem("EP8", "down", 2, 16, 32)
    words = torch.full((2, 16, 4), 0x11111111, dtype=torch.int32)  # no code 0
    scales = torch.ones(2, 16, 1, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="not uint4"):
        bh.build_humming_layer(p, words, scales, log=lambda m: None)


def test_missing_humming_keeps_chordq_numbers(tmp_path, monkeypatch):
    # the smallest shapes with whole row blocks (N % 128, K % 256), as the default w_order needs
    tiny = (bh.Problem("EP8", "gate_up", 12, 128, 256), bh.Problem("EP8", "down", 12, 256, 256))
    monkeypatch.setitem(bh.LAYOUTS, "EP8", tiny)
    monkeypatch.setattr(bh, "time_graphs", lambda fns, reps, calls: {
        n: {"graph_us": 10.0} for n in fns})
    result = bh.run_comparison((2,), ("EP8",), humming_wheel=str(tmp_path / "none.whl"),
                               opts=bh.Options(do_bench=False, fused=False), device="cpu")
    assert "FileNotFoundError" in result["meta"]["humming"]["error"]
    for r in result["rows"]:
        assert r["chordq"]["ok"] and r["chordq"]["graph_us"] == 10.0
        assert "humming unavailable" in r["humming"]["error"]
    assert bh.exit_status(result) == 2


def test_ratio_per_repetition_pairs_the_neighbours():
    """Run T's EP8 down T=2048 (H100): the medians' ratio is 1.15, the repetitions' 1.02,
    1.15, 1.06 as the card's clock drifted; the report shows both."""
    reps = bh.ratio_reps([898.1, 1012.8, 1047.4], [877.3, 879.2, 988.0])
    assert reps == pytest.approx([1.024, 1.152, 1.060], abs=1e-3)
    assert bh.ratio_reps([1.0, 2.0], [1.0]) is None and bh.ratio_reps(None, [1.0]) is None
    row = dict(_fake_row(config="(96,256,64) wgmma x1 ws", cos_diff=1e-8, ok=True,
                         graph_us=200.0), ratio_reps=reps)
    md = bh.render_markdown([row], {"calls": 20, "reps": 3})
    assert "| 2.00 | 1.02/1.15/1.06 |" in md


def test_alt_contestant_runs_under_its_overrides(fake_humming, tmp_path, monkeypatch):
    """``Options.alt``: a second chordq contestant whose launches are chosen with the given
    ``triton_config`` constants (seen by the kernel wrapper at call time), checked against the
    reference, timed beside chordq and reported as alt / chordq; the constants come back."""
    from chordq.kernels import triton_config, triton_w4a16

    tiny = (bh.Problem("EP8", "down", 12, 256, 256),)
    monkeypatch.setitem(bh.LAYOUTS, "EP8", tiny)
    timings = {"chordq": 40.0, "chordq_alt": 30.0, "humming": 20.0}
    monkeypatch.setattr(bh, "time_graphs", lambda fns, reps, calls: {
        n: {"graph_us": timings[n], "graph_reps": [timings[n]] * reps}
        for n in fns if n in timings})

    def spy_on(name):  # the constant each call of triton_w4a16.<name> sees
        real, seen = getattr(triton_w4a16, name), []

        def spy(*args, **kwargs):
            seen.append(triton_config.GLUON_PREFILL_STREAM_K_ROWS)
            return real(*args, **kwargs)

        monkeypatch.setattr(triton_w4a16, name, spy)
        return seen

    seen, tiles_seen = spy_on("moe_gemm_mixed_triton"), spy_on("row_tiles")
    before = triton_config.GLUON_PREFILL_STREAM_K_ROWS
    alt = {"GLUON_PREFILL_STREAM_K_ROWS": (96, 128)}
    result = bh.run_comparison((2,), ("EP8",), humming_wheel=str(fake_humming),
                               out_dir=tmp_path / "o", opts=bh.Options(
                                   check_routes=8, do_bench=False, alt=alt), device="cpu")
    (row,) = result["rows"]
    assert seen == [before, (96, 128)]  # chordq's first call, then the alt's
    assert tiles_seen == [before, (96, 128)]  # its row tiles are chosen under them too
    assert triton_config.GLUON_PREFILL_STREAM_K_ROWS == before
    assert row["chordq_alt"]["ok"] and row["chordq_alt"]["cos_diff"] < 1e-6
    assert row["ratio_alt"] == pytest.approx(0.75)
    assert row["ratio_alt_reps"] == pytest.approx([0.75] * 6)
    md = (tmp_path / "o" / "bench_humming.md").read_text()
    assert "chordq alt ({'GLUON_PREFILL_STREAM_K_ROWS': (96, 128)}) / chordq" in md
    assert "30.0 / 40.0, 0.750, 0.750/" in md
    assert row["alt_verdict"] == "wins" and md.count("): alt wins") == 1
    assert "alt verdicts (median beyond ±1% and every rep on one side): wins 1" in md
    assert bh.exit_status(result) == 0
    with pytest.raises(RuntimeError, match="inside"), bh.config_overrides(alt):
        assert triton_config.GLUON_PREFILL_STREAM_K_ROWS == (96, 128)
        raise RuntimeError("inside")
    assert triton_config.GLUON_PREFILL_STREAM_K_ROWS == before


@pytest.mark.parametrize("reps, ok, want", [
    ([0.97, 0.98, 0.96, 0.99, 0.97, 0.98], True, "wins"),
    ([0.97, 0.98, 0.96, 1.01, 0.97, 0.98], True, "level"),  # one rep the other way
    ([0.995, 0.996, 0.994, 0.995, 0.993, 0.996], True, "level"),  # every rep, under 1%
    ([1.03, 1.02, 1.05, 1.01, 1.04, 1.02], True, "loses"),
    ([1.03, 1.02, 0.99, 1.01, 1.04, 1.02], True, "level"),
    ([0.9] * 6, False, "wrong"),  # fast and wrong is wrong
    (None, True, "n/a"),
])
def test_alt_verdict(reps, ok, want):
    row = {"chordq_alt": {"ok": ok}, "ratio_alt_reps": reps}
    assert bh.alt_verdict(row) == want
    assert bh.alt_verdict({"chordq_alt": {"error": "boom"}, "ratio_alt_reps": [0.9] * 6}) == "wrong"


def test_gpu_checks_ab_mode_parses():
    """``scripts/gpu_checks.sh ab``'s bench lines parse, and each --alt names a tuple constant
    of triton_config (a renamed one would cost a device call to find)."""
    import re
    import shlex

    script = _script()
    text = (REPO / "scripts" / "gpu_checks.sh").read_text()
    lines = re.findall(r"^    B (\w+) (\d+) (.*)$", text, re.MULTILINE)
    assert [name for name, _, _ in lines] == ["h0", "s0", "d0", "w32"]
    for name, minutes, rest in lines:
        args = script.build_parser().parse_args(
            ["--against", "humming", "--max-minutes", minutes, *shlex.split(rest)])
        assert script.parse_alt(args.alt), name


def test_script_alt_flag():
    script = _script()
    assert script.parse_alt(["GLUON_PREFILL_STREAM_K_ROWS=64,96",
                             "GLUON_PREFILL_WIDE_STREAM_K_ROWS="]) == {
        "GLUON_PREFILL_STREAM_K_ROWS": (64, 96), "GLUON_PREFILL_WIDE_STREAM_K_ROWS": ()}
    assert script.parse_alt(None) is None
    with pytest.raises(SystemExit, match="not a tuple constant"):
        script.parse_alt(["GLUON_PREFILL_TILE=1"])
    assert script.parse_alt(["GLUON_STREAM_K_WAVES=0.9,1.25,2,2.6"]) == {
        "GLUON_STREAM_K_WAVES": (0.9, 1.25, 2, 2.6)}
    with pytest.raises(SystemExit, match="give numbers"):
        script.parse_alt(["GLUON_PREFILL_STREAM_K_ROWS=a"])
    args = script.build_parser().parse_args(
        ["--against", "humming", "--alt", "GLUON_PREFILL_STREAM_K_ROWS=96"])
    assert args.alt == ["GLUON_PREFILL_STREAM_K_ROWS=96"]
