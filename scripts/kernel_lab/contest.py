"""The kernel lab's side-by-side harness (GPU): lab tiles against the shipped Triton tiles and
Humming, same process and inputs, each checked against the reference on its own alignment and
timed with interleaved CUDA graphs. ``gluon_decode.py`` and ``gluon_prefill.py`` use it.

``run(rows, only, out_json, contestants)``: for each ``(layout, proj, tokens)`` in ``rows``
(``only``: a space-separated list of token counts, or ``layout/tokens`` rows, to keep; or
empty), seeded weights (once per shape) and routing (seed ``LAB_SEED``, default 0); the
contestants "shipped" (``choose_row_tiles`` without the Gluon row tiles: the Triton tiles,
and since session 22 the Gluon tile on 64-row blocks where ``choose_config`` takes it) and
"humming" (when ``GLUON_HUMMING`` names the folder of its wheel), "triton" (``LAB_TRITON=1``:
the Triton tile on the shipped blocks, where those are one size, on the ``extra_weights``
words when given: the row-blocked ones the bench runs); then ``contestants(ctx,
add)`` registers the lab's: ``add(name, block, launch, act=None)`` with
``launch(out, aligned, blocks)`` on ``moe_align_block_size(topk, block)``'s buffers.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

from chordq.kernels import bench as B
from chordq.kernels import bench_humming as H
from chordq.kernels.align import align_row_tiles, moe_align_block_size
from chordq.kernels.reference import cos_diff, moe_gemm_indexed_reference
from chordq.kernels.triton_config import choose_config, choose_row_tiles
from chordq.kernels.triton_w4a16 import moe_gemm_indexed_triton, moe_gemm_mixed_triton


def gluon_decode(c, words: torch.Tensor, scales: torch.Tensor, **kw):
    """A contestant's ``launch`` for ``gluon_w4a16.moe_gemm_indexed_gluon`` on row ``c`` with
    these words and scales; ``kw``: the tile's keyword arguments (``block_n`` ...)."""
    from chordq.kernels.gluon_w4a16 import moe_gemm_indexed_gluon

    return lambda out, a, nb: moe_gemm_indexed_gluon(
        c.x, words, scales, *a, c.p.top_k, out, num_routes=c.rows, grid_m=nb, **kw)


def blocked_weights(words: torch.Tensor, scales: torch.Tensor):
    """``run``'s ``extra_weights`` for the row-blocked words and scales ``prepare_weights``
    ships (``ctx.extra``; the contest's own ``ctx.wf``, ``ctx.sf`` are unblocked)."""
    return H.convert_weights(words, scales, "blocked")


def _first_line(exc: BaseException) -> str:
    return (str(exc) or repr(exc)).strip().splitlines()[-1][:300]


def run(rows, only: str, out_json: str, contestants, extra_weights=None) -> list[dict]:
    """See the module docstring; ``extra_weights(w, scales)`` adds lab-order copies of the
    weights to ``ctx.extra``. Writes and returns one result per contestant and row."""
    os.makedirs(os.path.dirname(out_json) or ".", exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(int(os.environ.get("LAB_SEED", "0")))
    weights, results, layers = {}, [], {}
    wheel = os.environ.get("GLUON_HUMMING")
    if wheel:
        H.import_humming(H.install_humming(wheel))
    for layout, proj, tokens in rows:
        if only and not {str(tokens), f"{layout}/{tokens}"} & set(only.split()):
            continue
        p = next(q for q in H.LAYOUTS[layout] if q.proj == proj)
        if (layout, proj) not in weights:
            w, sc = H.make_weights(p, 0, "cuda")
            extra = extra_weights(w, sc) if extra_weights else ()
            weights[(layout, proj)] = (w, sc, *H.convert_weights(w, sc, "subnormal"), extra)
            if wheel:
                layers[(layout, proj)] = (H.build_humming_layer(p, w, sc)[0], {})
        w, sc, wf, sf, extra = weights[(layout, proj)]
        topk = torch.rand(tokens, p.num_experts, generator=gen, device="cuda").topk(8, -1)
        topk = topk.indices.to(torch.int32)
        n_rows = 8 * tokens
        x = torch.randn(p.input_rows(tokens), p.k, generator=gen, device="cuda").to(torch.bfloat16)
        touched = int(torch.unique(topk).numel())
        floor_us = H.floor_model(p, tokens, touched)["floor_us"]
        fns, outs = {}, {}

        def add(name, block, launch, act=None):
            aligned = moe_align_block_size(topk, block, p.num_experts)
            out = torch.zeros(n_rows, p.n // 2 if act else p.n, dtype=torch.bfloat16,
                              device="cuda")
            blocks = int(aligned[2][0]) // block  # read here: no host sync inside a capture
            fns[name] = lambda: launch(out, aligned, blocks)
            outs[name] = (out, (block, act))

        tiles = choose_row_tiles(n_rows / p.num_experts, p.n, p.k)
        pieces = align_row_tiles(topk, tiles, p.num_experts)
        add("shipped", tiles[0], lambda out, a, nb: moe_gemm_mixed_triton(
            x, wf, sf, pieces, p.top_k, out=out, w_order="subnormal"))
        if os.environ.get("LAB_TRITON") == "1" and len(tiles) == 1 and tiles[0] not in (8, 96):
            # the Triton tile on the same blocks, where a Gluon tile replaced it in "shipped"
            cfg = choose_config(n_rows / p.num_experts, p.n, p.k, block_m=tiles[0],
                                w_order="subnormal")
            tw, ts, order = (*extra, "blocked") if extra else (wf, sf, "subnormal")
            add("triton", tiles[0], lambda out, a, nb, cfg=cfg, tw=tw, ts=ts, order=order:
                moe_gemm_indexed_triton(x, tw, ts, *a, p.top_k, cfg.block_m, num_routes=n_rows,
                                        config=cfg, out=out, w_order=order))
        if wheel:
            layer, cache = layers[(layout, proj)]
            cfg, _ = H.humming_config(layer, n_rows, cache)
            h_aligned, _ = H.humming_align(topk, p.num_experts, int(cfg["block_shape"][0]))
            cfg_json = json.dumps(cfg)
            add("humming", int(cfg["block_shape"][0]), lambda out, a, nb: layer(
                x, outputs=out, sorted_ids=h_aligned[0], expert_ids=h_aligned[1],
                num_tokens_padded=h_aligned[2], top_k=p.top_k,
                compute_config=H.HUMMING_COMPUTE_CONFIG, tuning_config=cfg_json))
        ctx = SimpleNamespace(p=p, proj=proj, x=x, wf=wf, sf=sf, extra=extra, rows=n_rows,
                              topk=topk)
        contestants(ctx, add)

        errors, cos, wants = {}, {}, {}
        for name, fn in list(fns.items()):
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                errors[name] = _first_line(exc)
                print(f"  {name}: {errors[name]}", flush=True)
                del fns[name]
        for name, (o, (block, act)) in outs.items():
            if name in errors:
                continue
            if (block, act) not in wants:
                wants[(block, act)] = moe_gemm_indexed_reference(
                    x, w, sc, *moe_align_block_size(topk, block, p.num_experts), p.top_k,
                    block, activation=act)
            cos[name] = cos_diff(o, wants[(block, act)])
            if cos[name] != cos[name]:  # nan: say what came out
                print(f"  {name}: nan {int(o.isnan().sum())}, zero rows "
                      f"{int((o == 0).all(1).sum())} of {o.shape[0]}, max {o.float().abs().max()}")
        times = H.time_graphs(fns, 7, B.GRAPH_CALLS)
        base = times["shipped"].get("graph_us")
        hum = times.get("humming", {}).get("graph_us")
        for name in fns:
            us = times[name].get("graph_us")
            r = {"layout": layout, "proj": proj, "T": tokens, "touched": touched, "variant": name,
                 "graph_us": us, "cos_diff": cos[name], "floor_us": floor_us,
                 "vs_shipped": us / base if us and base else None,
                 "vs_humming": us / hum if us and hum else None}
            results.append(r)
            print(f"{layout} {proj:7s} T={tokens:4d} {name:28s} "
                  f"{us or float('nan'):8.1f} µs {100 * floor_us / us if us else 0:5.1f}% "
                  f"x{r['vs_shipped'] or 0:.3f} /H {r['vs_humming'] or 0:.3f} "
                  f"cos={cos[name]:.1e} {times[name].get('graph_error', '')}", flush=True)
        with open(out_json, "w") as f:
            json.dump(results, f, indent=1)
    return results
