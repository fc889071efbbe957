"""Compute checks: per MoE layer, a seeded sample of experts run as a MoE, three ways.

The sampled experts run on RMS-normed activations routed by the layer's own router (Kimi
``noaux_tc``): a float32 MoE on the source weights, the PyTorch INT4 reference and the Triton
kernel on the output words (on CPU interpreted, on the most-routed sampled experts within a
weight budget). Kernel vs reference must agree within ``KERNEL_MAX_COS_DIFF``, the INT4 MoE vs
the source MoE within ``INT4_MAX_COS_DIFF``. Plus the words through Chord's indexed layout and
back, and Chord's reading of sampled codes (format.md §4.2 closed form) against the codes
chordq wrote.
"""

from __future__ import annotations

import collections
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from .layout import (
    chord_indexed_scale,
    chord_indexed_scale_inverse,
    chord_indexed_weight,
    chord_indexed_weight_inverse,
    unpack_codes,
)
from .models import PROJECTIONS, TextArch, text_config
from .shards import Checkpoint
from .verify_findings import _Findings
from .verify_math import _first_mismatch
from .verify_thresholds import (
    COMPUTE_TOKENS,
    DEFAULT_EXPERTS_PER_LAYER,
    INT4_MAX_COS_DIFF,
    INTERPRETED_KERNEL_MAX_WEIGHTS,
    KERNEL_MAX_COS_DIFF,
    LAYOUT_SPOT_CODES,
    ROUTING_POOL_TOKENS,
    SEED,
    SMALL_MODEL_EXPERTS,
)

# ---------------------------------------------------------------------------------------------
# sampling and the interpreter


def _sample(n_experts: int, k: int | None, layer: int) -> list[int]:
    if k is None:
        k = n_experts if n_experts <= SMALL_MODEL_EXPERTS else DEFAULT_EXPERTS_PER_LAYER
    k = max(0, min(k, n_experts))
    if k == n_experts:
        return list(range(n_experts))
    g = torch.Generator().manual_seed(SEED * 100003 + layer)
    return sorted(torch.randperm(n_experts, generator=g)[:k].tolist())


def _ensure_interpreter(device: torch.device) -> str | None:
    """Triton on CPU runs interpreted, and TRITON_INTERPRET=1 must be set before *triton itself*
    is first imported (compressed-tensors imports it too): triton's own ``@jit`` library
    functions are built at that import. Returns why the Triton kernel cannot run here, or None.
    """
    if device.type != "cpu":
        return None
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
        return None
    import triton.language.standard as tl_standard

    if type(tl_standard.sigmoid).__name__ == "InterpretedFunction":
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels module may still be imported
        return None
    return (
        "triton was imported in this process before TRITON_INTERPRET=1 was set, so its CPU "
        "interpreter is off; run with TRITON_INTERPRET=1 in the environment"
    )


# ---------------------------------------------------------------------------------------------
# the MoE of the sampled experts, three ways


def _activations(
    ckpt: Checkpoint, arch: TextArch, layer: int, tokens: int, read: Callable
) -> torch.Tensor:
    """BF16 [tokens, H]: seeded hidden states, RMS-normed and scaled by the layer's own
    ``post_attention_layernorm`` (what the router and the experts see in the model)."""
    g = torch.Generator().manual_seed(SEED * 7919 + layer)
    h = torch.randn(tokens, arch.hidden_size, generator=g)
    # a few massive-activation channels, as in real LLM residual streams
    hot = torch.randperm(arch.hidden_size, generator=g)[: max(1, arch.hidden_size // 256)]
    h[:, hot] *= 8.0
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    norm = ckpt.tensors.get(f"{arch.prefix}layers.{layer}.post_attention_layernorm.weight")
    if norm is not None and norm.shape == (arch.hidden_size,):
        x = x * read(norm).float()
    return x.to(torch.bfloat16)


def _moe_float(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """Plain float32 MoE on float weights ``[S, I, H]``, ``[S, I, H]``, ``[S, H, I]``."""
    xf = x.float()
    out = torch.zeros_like(xf)
    for e in ids[ids >= 0].unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        a = torch.nn.functional.silu(xf[tok] @ gate[e].T) * (xf[tok] @ up[e].T)
        out.index_add_(0, tok, (a @ down[e].T) * weights[tok, slot].float().unsqueeze(-1))
    return out


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = float(b.norm())
    return float((a - b).norm()) / den if den else (0.0 if float(a.norm()) == 0 else math.inf)


def _chord_code(
    packed: torch.Tensor, n: torch.Tensor, k: torch.Tensor, layout: str
) -> torch.Tensor:
    """The code Chord's kernel reads for checkpoint ``(n, k)`` out of its indexed words
    ``[..., K/16, 2N]``: format.md §4.2 solved for (row, column, nibble), independently of
    layout.py."""
    nb, t, i4 = n // 64, (n % 64) // 16, (n % 16) // 8
    r, i5, kk = k // 16, (k % 16) // 8, k % 2
    lane = (n % 8) * 4 + (k % 8) // 2
    c = nb * 128 + lane * 4 + t
    a, b = (i4, i5) if layout == "mma" else (i5, i4)
    s = 4 * a + 2 * b + kk
    p = s // 2 + 4 * (s % 2)
    return (packed[..., r, c] >> (4 * p)) & 0xF


def _check_chord_layout(
    layer: int,
    experts: list[int],
    stacks: dict[str, tuple[torch.Tensor, torch.Tensor]],
    f: _Findings,
) -> dict[str, Any]:
    """Checkpoint words -> Chord's indexed layout -> back, bit for bit; and every code Chord
    reads (closed form) equals the code chordq wrote."""
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(SEED + layer)
    for name, (words, scale) in stacks.items():
        n, k = words.shape[1], words.shape[2] * 8
        if n % 128 or k % 64:
            out[name] = (
                f"skipped (N={n}, K={k}: Chord's indexed layout needs N % 128 == 0, K % 64 == 0)"
            )
            continue
        codes = unpack_codes(words)
        for layout in ("mma", "wgmma"):
            packed = chord_indexed_weight(words, layout)
            back = chord_indexed_weight_inverse(packed, layout)
            mm = _first_mismatch(back, words)
            if mm is not None:
                coord, a, b, count = mm
                e = experts[coord[0]]
                f.fail(
                    "compute.layout",
                    f"layer {layer} expert {e} {name}: Chord {layout} layout round trip differs at "
                    f"word {list(coord[1:])}: 0x{a & 0xFFFFFFFF:08x} vs 0x{b & 0xFFFFFFFF:08x} "
                    f"({count} words)",
                    layer=layer,
                    expert=e,
                )
            nn = torch.randint(0, n, (LAYOUT_SPOT_CODES,), generator=g)
            kk = torch.randint(0, k, (LAYOUT_SPOT_CODES,), generator=g)
            got = _chord_code(packed, nn, kk, layout).to(torch.uint8)  # [E, spots]
            bad = (got != codes[:, nn, kk]).nonzero()
            if len(bad):
                i, j = (int(v) for v in bad[0])
                f.fail(
                    "compute.layout",
                    f"layer {layer} expert {experts[i]} {name}: Chord's {layout} kernel would read "
                    f"code {int(got[i, j])} "
                    f"at [n={int(nn[j])}, k={int(kk[j])}], chordq wrote "
                    f"{int(codes[i, nn[j], kk[j]])}",
                    layer=layer,
                    expert=experts[i],
                )
        s_back = chord_indexed_scale_inverse(chord_indexed_scale(scale))
        if _first_mismatch(s_back, scale) is not None:
            f.fail(
                "compute.layout",
                f"layer {layer} {name}: Chord indexed scale round trip is not exact",
                layer=layer,
            )
        out[name] = "ok"
    return out


def _compute_layer(
    layer: int,
    ckpt: Checkpoint,
    arch: TextArch,
    experts: list[int],
    cache: dict,
    has_source: bool,
    device: torch.device,
    kernel_issue: str | None,
    read: Callable,
    f: _Findings,
) -> dict[str, Any]:
    from .kernels import cos_diff, fused_moe, route

    tc = text_config(ckpt.config)
    experts = [e for e in experts if all((e, p) in cache for p in PROJECTIONS)]
    result: dict[str, Any] = {"layer": layer, "experts": experts}
    if not experts:
        result["skipped"] = "no sampled expert is complete"
        return result
    gate_name = f"{arch.prefix}layers.{layer}.mlp.gate.weight"
    bias_name = f"{arch.prefix}layers.{layer}.mlp.gate.e_score_correction_bias"
    if gate_name not in ckpt.tensors:
        f.fail(
            "compute.router",
            f"layer {layer}: router weight {gate_name} is missing",
            layer=layer,
            tensor=gate_name,
        )
        return result
    router = read(ckpt.tensors[gate_name]).float()
    bias = (
        read(ckpt.tensors[bias_name]).float()
        if bias_name in ckpt.tensors
        else torch.zeros(router.shape[0])
    )
    top_k = int(tc.get("num_experts_per_tok") or arch.num_experts_per_tok)
    scaling = float(tc.get("routed_scaling_factor") or 1.0)
    n_group, topk_group = int(tc.get("n_group") or 1), int(tc.get("topk_group") or 1)
    renorm = bool(tc.get("norm_topk_prob", True))
    full = len(experts) == arch.n_routed_experts
    pool = _activations(ckpt, arch, layer, COMPUTE_TOKENS if full else ROUTING_POOL_TOKENS, read)
    weights, ids = route(pool.float() @ router.T, bias, top_k, scaling, n_group, topk_group, renorm)
    local = torch.full((arch.n_routed_experts,), -1, dtype=torch.int32)
    local[torch.tensor(experts)] = torch.arange(len(experts), dtype=torch.int32)
    lids = local[ids.long()]
    if not full:  # keep the tokens that reach a sampled expert
        keep = (lids >= 0).any(dim=1).nonzero().squeeze(1)[:COMPUTE_TOKENS]
        pool, weights, lids = pool[keep], weights[keep], lids[keep]
    routes = collections.Counter(int(e) for e in lids[lids >= 0].tolist())
    result.update(
        {
            "tokens": int(pool.shape[0]),
            "top_k": top_k,
            "routes": int(sum(routes.values())),
            "experts_hit": len(routes),
        }
    )
    if not routes:
        f.warn(
            "compute.routing",
            f"layer {layer}: no token of {ROUTING_POOL_TOKENS} reached the sampled experts; "
            "compute not checked",
            layer=layer,
        )
        return result

    def stack(proj: str, part: str) -> torch.Tensor:
        return torch.stack([cache[(e, proj)][part] for e in experts])

    w13 = torch.cat([stack("gate_proj", "packed"), stack("up_proj", "packed")], dim=1).contiguous()
    s13 = torch.cat([stack("gate_proj", "scale"), stack("up_proj", "scale")], dim=1).contiguous()
    w2, s2 = stack("down_proj", "packed").contiguous(), stack("down_proj", "scale").contiguous()
    # The kernel's own check: every sampled expert on a GPU; interpreted on CPU, the most routed
    # of them within INTERPRETED_KERNEL_MAX_WEIGHTS (at least one), checked against the reference
    # on the same routes. The Chord layout check (CPU work of the same order) takes that subset.
    n_kernel = len(experts)
    if device.type == "cpu":
        per_expert = 3 * arch.hidden_size * arch.moe_intermediate_size
        n_kernel = max(1, min(len(experts), INTERPRETED_KERNEL_MAX_WEIGHTS // per_expert))
    chosen = sorted(i for i, _ in routes.most_common(n_kernel)) if n_kernel < len(experts) else None
    sub = chosen if chosen is not None else list(range(len(experts)))
    result["kernel_experts"] = [experts[i] for i in sub]
    result["chord_layout"] = _check_chord_layout(
        layer,
        result["kernel_experts"],
        {"w13 (gate+up)": (w13[sub], s13[sub]), "w2 (down)": (w2[sub], s2[sub])},
        f,
    )
    x = pool.to(device)
    weights_d, lids_d = weights.to(device), lids.to(device)
    stacks = [t.to(device) for t in (w13, s13, w2, s2)]
    ref = fused_moe(x, *stacks, weights_d, lids_d, impl="reference").float().cpu()
    outputs = {"int4_reference": ref}
    kids = lids_d
    if chosen is not None:
        kids = torch.where(torch.isin(lids_d, torch.tensor(chosen, device=device)), lids_d, -1)
    if kernel_issue is None:
        try:
            outputs["triton"] = fused_moe(x, *stacks, weights_d, kids, impl="triton").float().cpu()
            outputs["kernel_reference"] = (
                ref
                if kids is lids_d
                else fused_moe(x, *stacks, weights_d, kids, impl="reference").float().cpu()
            )
        except Exception as e:  # noqa: BLE001 - a kernel crash on these words is a failed check
            f.fail(
                "compute.kernel",
                f"layer {layer}: the Triton kernel raised {type(e).__name__}: {e}",
                layer=layer,
            )
    else:
        f.warn(
            "compute.kernel", f"layer {layer}: Triton kernel not run: {kernel_issue}", layer=layer
        )
    if has_source and all(
        cache[(e, p)]["source"] is not None for e in experts for p in PROJECTIONS
    ):
        srcw = {p: torch.stack([cache[(e, p)]["source"] for e in experts]) for p in PROJECTIONS}
        outputs["source"] = _moe_float(
            pool, srcw["gate_proj"], srcw["up_proj"], srcw["down_proj"], weights, lids
        )
    pairs = {}
    comparisons = [
        ("triton", "kernel_reference", "triton_vs_int4_reference"),
        ("int4_reference", "source", "int4_reference_vs_source"),
    ]
    if chosen is None:
        comparisons.append(("triton", "source", "triton_vs_source"))
    for a, b, key in comparisons:
        if a in outputs and b in outputs:
            pairs[key] = {
                "cos_diff": cos_diff(outputs[a], outputs[b]),
                "rel_err": _rel_err(outputs[a], outputs[b]),
            }
    result["pairs"] = pairs
    kern = pairs.get("triton_vs_int4_reference")
    if kern is not None and not kern["cos_diff"] <= KERNEL_MAX_COS_DIFF:
        f.fail(
            "compute.kernel",
            f"layer {layer}: Triton kernel vs INT4 reference cos_diff {kern['cos_diff']:.3e} > "
            f"{KERNEL_MAX_COS_DIFF:g} on experts {result['kernel_experts'][:8]}",
            layer=layer,
        )
    fid = pairs.get("int4_reference_vs_source")
    if fid is not None and not fid["cos_diff"] <= INT4_MAX_COS_DIFF:
        f.fail(
            "compute.fidelity",
            f"layer {layer}: INT4 MoE output vs the source-weight MoE cos_diff "
            f"{fid['cos_diff']:.3e} > {INT4_MAX_COS_DIFF:g} "
            f"(relative error {fid['rel_err']:.3f}) on {len(routes)} experts",
            layer=layer,
        )
    return result
