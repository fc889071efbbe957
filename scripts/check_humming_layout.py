"""Check chordq's CPU twins of Chord's indexed layouts against humming on a GPU (format.md §4).

Builds random codes over all 16 levels, packs checkpoint words (format.md §2.1), runs humming's
``transform_humming_weight(words, uint4, bfloat16, packed=True)`` and
``transform_humming_weight_scale(scale)``, and compares them word for word with
``chordq.layout.chord_indexed_weight(words, "mma")`` and ``chord_indexed_scale(scale)``.
format.md §4.2 says the two agree 100% (upstream Humming's W4A16 layout = Chord's ``mma``).

Needs a CUDA GPU (humming JIT-compiles its repack kernel) and the humming-kernels package::

    python scripts/check_humming_layout.py --humming-path /path/to/humming_kernels-0.1.19-....whl \\
        --out humming_layout.json

``--humming-path`` may be a wheel (unpacked to a temp dir), a folder that holds ``humming/``
(e.g. a site-packages or ``pip install --target`` dir), or the ``humming`` package folder itself;
leave it out to use an installed humming. Every step prints what it found; the JSON report is
written even when a step fails. Exit status: 0 when every comparison matched 100%, 1 when some
did not, 2 when the check could not run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import platform
import sys
import tempfile
import traceback
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent
WEIGHT_NAMES = ("transform_humming_weight", "prepare_humming_weight")  # new name, old name
SCALE_NAMES = ("transform_humming_weight_scale", "prepare_humming_weight_scale")
LIKELY_MODULES = ("humming.transform", "humming.utils.weight", "humming.kernel.transform",
                  "humming.utils.transform", "humming.layer", "humming")
DEFAULT_SHAPES = "2,256,512;0,256,512;1,4096,7168;2,7168,2048"  # E,N,K; E=0 means 2-D [N, K/8]


def log(msg: str = "") -> None:
    print(msg, flush=True)


class Report:
    """Collects step results; written as JSON at the end, whatever happened."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {"steps": [], "cases": [], "verdict": "not run"}

    def step(self, step: str, ok: bool, **detail: Any) -> None:
        self.data["steps"].append({"step": step, "ok": ok, **detail})
        log(f"[{'ok' if ok else 'FAILED'}] {step}" + (f": {detail}" if detail else ""))

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        log(f"wrote {path}")


# --- loading ------------------------------------------------------------------------------------


def load_chordq_layout():
    """chordq.layout, or the file itself when chordq's other dependencies are not installed."""
    sys.path.append(str(REPO))  # behind site-packages: kernels/ must not shadow HF `kernels`
    try:
        from chordq import layout

        return layout, "import chordq.layout"
    except Exception as exc:  # noqa: BLE001 - report and fall back
        log(f"import chordq.layout failed ({type(exc).__name__}: {exc}); loading the file directly")
    spec = importlib.util.spec_from_file_location("chordq_layout", REPO / "chordq" / "layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, str(REPO / "chordq" / "layout.py")


def add_humming_path(path: str | None) -> str | None:
    if not path:
        return None
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise FileNotFoundError(f"--humming-path {p} does not exist")
    if p.is_file() and p.suffix == ".whl":
        dest = Path(tempfile.mkdtemp(prefix="humming-wheel-"))
        with zipfile.ZipFile(p) as z:
            z.extractall(dest)
            for info in z.infolist():  # extractall drops the mode bits (humming ships binaries)
                mode = (info.external_attr >> 16) & 0o777
                if mode and not info.is_dir():
                    (dest / info.filename).chmod(mode)
        log(f"unpacked wheel {p.name} to {dest}")
        p = dest
    elif p.is_dir() and p.name == "humming" and (p / "__init__.py").exists():
        p = p.parent  # the package folder itself was given
    if not (p / "humming" / "__init__.py").exists():
        log(f"warning: {p} holds no humming/__init__.py; adding it to sys.path anyway")
    sys.path.insert(0, str(p))
    return str(p)


def humming_info(humming) -> dict[str, Any]:
    info: dict[str, Any] = {"file": getattr(humming, "__file__", None),
                            "__version__": getattr(humming, "__version__", None)}
    for dist in ("humming-kernels", "humming_kernels", "humming"):
        try:
            from importlib.metadata import version

            info[f"dist {dist}"] = version(dist)
        except Exception:  # noqa: BLE001
            pass
    return info


def find_function(names: tuple[str, ...], package_dir: Path) -> tuple[Callable | None, list[str]]:
    """Look for the first of ``names`` in likely modules, then in any humming module whose
    source defines it. Returns (function, every place it was found or failed)."""
    found: list[tuple[str, Callable]] = []
    notes: list[str] = []

    def probe(mod_name: str) -> None:
        try:
            mod = importlib.import_module(mod_name)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"import {mod_name} failed: {type(exc).__name__}: {exc}")
            return
        for name in names:
            fn = getattr(mod, name, None)
            if callable(fn):
                found.append((f"{mod_name}.{name}", fn))

    for mod_name in LIKELY_MODULES:
        probe(mod_name)
    if not found:  # scan the sources without importing everything
        for py in sorted(package_dir.rglob("*.py")):
            text = py.read_text(errors="replace")
            if any(f"def {name}(" in text for name in names):
                rel = py.relative_to(package_dir.parent).with_suffix("")
                mod_name = ".".join(rel.parts).removesuffix(".__init__")
                notes.append(f"source {py} defines one of {names}")
                probe(mod_name)
    where = [f"{label} (defined in {getattr(fn, '__module__', '?')})" for label, fn in found]
    for label in where:
        log(f"  found {label}")
    for note in notes:
        log(f"  note: {note}")
    # prefer the first name (the current one), then the module that defines it
    found.sort(key=lambda item: (names.index(item[0].rsplit(".", 1)[1]),
                                 item[0].rsplit(".", 1)[0] != getattr(item[1], "__module__", "")))
    return (found[0][1] if found else None), where + [f"note: {n}" for n in notes]


def humming_dtypes():
    dtypes = importlib.import_module("humming.dtypes")
    out = {}
    for name in ("uint4", "bfloat16"):
        value = getattr(dtypes, name, None)
        if value is None and hasattr(dtypes, "DataType"):
            value = dtypes.DataType.from_str(name)
        out[name] = value if value is not None else name  # a string as the last resort
    return out


# --- comparisons --------------------------------------------------------------------------------


def as_int_view(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reinterpret ``t`` with ``like``'s dtype and shape when the bytes allow it."""
    if t.dtype != like.dtype and t.element_size() == like.element_size():
        t = t.view(like.dtype)
    elif t.dtype != like.dtype:
        t = t.contiguous().view(torch.uint8).view(like.dtype)
    if t.shape != like.shape and t.numel() == like.numel():
        t = t.reshape(like.shape)
    return t


def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    res: dict[str, Any] = {"got_shape": list(got.shape), "got_dtype": str(got.dtype),
                           "want_shape": list(want.shape), "want_dtype": str(want.dtype)}
    try:
        g = as_int_view(got, want)
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"cannot view humming output as {want.dtype} {tuple(want.shape)}: {exc}"
        return res
    if g.shape != want.shape:
        res["error"] = f"shape {tuple(g.shape)} vs {tuple(want.shape)} (numel differs)"
        return res
    if g.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32}[g.element_size()]
        g, want = g.view(bits), want.view(bits)
    eq = g == want
    res["match_pct"] = 100.0 * eq.float().mean().item()
    res["mismatches"] = int((~eq).sum())
    if res["mismatches"]:
        first = tuple(int(i) for i in (~eq).nonzero()[0])
        mask = (1 << 8 * g.element_size()) - 1
        res["first_mismatch"] = {"at": first, "got": hex(int(g[first]) & mask),
                                 "want": hex(int(want[first]) & mask)}
    if g.dtype == torch.int32:  # per-nibble agreement helps tell a nibble order slip from chaos
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        gn = (g.unsqueeze(-1) >> shifts) & 0xF
        wn = (want.unsqueeze(-1) >> shifts) & 0xF
        res["nibble_match_pct"] = 100.0 * (gn == wn).float().mean().item()
    return res


def call_flexibly(fn: Callable, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, str]:
    """Call ``fn``, dropping keyword arguments its signature lacks; return (result, call text)."""
    try:
        params = inspect.signature(fn).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            dropped = [k for k in kwargs if k not in params]
            if dropped:
                log(f"  note: {fn.__name__} takes no {dropped}; calling without them")
            kwargs = {k: v for k, v in kwargs.items() if k in params}
    except (TypeError, ValueError):
        pass
    text = f"{fn.__module__}.{fn.__name__}(<{len(args)} positional>, {sorted(kwargs)})"
    out = fn(*args, **kwargs)
    if isinstance(out, (tuple, list)):
        log(f"  note: {fn.__name__} returned a {type(out).__name__} of {len(out)}; using item 0")
        out = out[0]
    return out, text


def run_case(shape: tuple[int, int, int], layout, fns: dict, dt: dict, device: str,
             seed: int) -> dict[str, Any]:
    e, n, k = shape
    case: dict[str, Any] = {"E": e, "N": n, "K": k, "two_d": e == 0}
    g = torch.Generator().manual_seed(seed)
    lead = () if e == 0 else (e,)
    codes = torch.randint(0, 16, (*lead, n, k), generator=g, dtype=torch.uint8)
    codes.view(-1)[:16] = torch.arange(16, dtype=torch.uint8)  # all 16 levels, surely
    words = layout.pack_codes(codes)
    scale = torch.randn(*lead, n, k // 32, generator=g).to(torch.bfloat16)
    levels = torch.bincount(codes.view(-1).long(), minlength=16)
    case["levels_present"] = int((levels > 0).sum())

    want = {lay: layout.chord_indexed_weight(words, lay) for lay in ("mma", "wgmma")}
    fn_w = fns.get("weight")
    if fn_w is not None:
        for use_wgmma in (False, True):
            key = "weight_use_wgmma" if use_wgmma else "weight"
            try:
                kwargs: dict[str, Any] = {"packed": True}
                if use_wgmma:
                    kwargs["use_wgmma"] = True
                    if "use_wgmma" not in inspect.signature(fn_w).parameters:
                        case[key] = {"skipped": "no use_wgmma argument"}
                        continue
                out, text = call_flexibly(fn_w, (words.to(device).contiguous(), dt["uint4"],
                                                 dt["bfloat16"]), kwargs)
                torch.cuda.synchronize()
                out = out.cpu()
                res = {"call": text}
                ref = "wgmma" if use_wgmma else "mma"
                res[f"vs_chord_{ref}"] = compare(out, want[ref])
                other = "mma" if use_wgmma else "wgmma"
                res[f"vs_chord_{other}"] = compare(out, want[other])
                # diagnostic: would the words match if humming stored q = code - 8 (code ^ 8)?
                flipped = want[ref] ^ torch.tensor(0x88888888 - (1 << 32), dtype=torch.int32)
                res[f"vs_chord_{ref}_xor8"] = compare(out, flipped)
                case[key] = res
                log(f"  {shape} {key}: {text}")
                for name, r in res.items():
                    if isinstance(r, dict):
                        log(f"    {name}: match {r.get('match_pct', 'n/a')}% words, "
                            f"{r.get('nibble_match_pct', 'n/a')}% nibbles"
                            + (f", first mismatch {r['first_mismatch']}" if "first_mismatch" in r
                               else "") + (f", error {r['error']}" if "error" in r else ""))
            except Exception as exc:  # noqa: BLE001
                case[key] = {"error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()}
                log(f"  {shape} {key} FAILED: {type(exc).__name__}: {exc}")
    fn_s = fns.get("scale")
    if fn_s is not None:
        try:
            out, text = call_flexibly(fn_s, (scale.to(device).contiguous(),), {})
            torch.cuda.synchronize()
            out = out.cpu()
            res = {"call": text,
                   "vs_chord_indexed_scale": compare(out, layout.chord_indexed_scale(scale)),
                   "vs_plain_transpose": compare(out, scale.transpose(-1, -2).contiguous())}
            case["scale"] = res
            log(f"  {shape} scale: {text}")
            for name, r in res.items():
                if isinstance(r, dict):
                    log(f"    {name}: match {r.get('match_pct', 'n/a')}%"
                        + (f", first mismatch {r['first_mismatch']}" if "first_mismatch" in r
                           else "") + (f", error {r['error']}" if "error" in r else ""))
        except Exception as exc:  # noqa: BLE001
            case["scale"] = {"error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()}
            log(f"  {shape} scale FAILED: {type(exc).__name__}: {exc}")
    return case


def verdict(cases: list[dict[str, Any]]) -> tuple[str, bool]:
    checks = []
    for c in cases:
        checks.append(c.get("weight", {}).get("vs_chord_mma", {}).get("match_pct"))
        checks.append(c.get("scale", {}).get("vs_chord_indexed_scale", {}).get("match_pct"))
    if not checks or any(x is None for x in checks):
        return "incomplete: some comparisons did not run (see steps and cases)", False
    if all(x == 100.0 for x in checks):
        return "PASS: humming == chord_indexed_weight(mma) and chord_indexed_scale, 100%", True
    return f"MISMATCH: match percentages {checks}", False


# --- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--humming-path", help="humming wheel, a folder holding humming/, or humming/")
    ap.add_argument("--out", default="humming_layout_check.json", help="JSON report path")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES,
                    help=f"'E,N,K;...' (E=0: 2-D input); default {DEFAULT_SHAPES}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)

    rep = Report()
    rep.data["argv"] = sys.argv
    rep.data["env"] = {"python": sys.version, "platform": platform.platform(),
                       "torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    status = 2
    try:
        layout, where = load_chordq_layout()
        rep.step("load chordq.layout", True, source=where)

        if not torch.cuda.is_available():
            rep.step("CUDA device", False, error="torch.cuda.is_available() is False")
            return status
        rep.data["env"]["gpu"] = torch.cuda.get_device_name()
        rep.data["env"]["capability"] = torch.cuda.get_device_capability()
        rep.step("CUDA device", True, name=rep.data["env"]["gpu"])

        try:
            added = add_humming_path(args.humming_path)
            humming = importlib.import_module("humming")
            info = humming_info(humming)
            rep.data["humming"] = {"sys_path_added": added, **info}
            rep.step("import humming", True, **info)
        except Exception as exc:  # noqa: BLE001
            rep.step("import humming", False, error=f"{type(exc).__name__}: {exc}",
                     traceback=traceback.format_exc())
            return status
        package_dir = Path(humming.__file__).parent

        fns: dict[str, Callable | None] = {}
        for key, names in (("weight", WEIGHT_NAMES), ("scale", SCALE_NAMES)):
            log(f"searching humming for {names[0]} (or {names[1:]})")
            fn, where_found = find_function(names, package_dir)
            fns[key] = fn
            rep.data.setdefault("functions", {})[key] = {
                "used": f"{fn.__module__}.{fn.__name__}" if fn else None,
                "signature": str(inspect.signature(fn)) if fn else None,
                "found": where_found,
            }
            rep.step(f"find {names[0]}", fn is not None, used=rep.data["functions"][key]["used"])
        if not any(fns.values()):
            return status

        try:
            dt = humming_dtypes()
            rep.step("humming dtypes", True, **{k: repr(v) for k, v in dt.items()})
        except Exception as exc:  # noqa: BLE001
            rep.step("humming dtypes", False, error=f"{type(exc).__name__}: {exc}")
            dt = {"uint4": "uint4", "bfloat16": "bfloat16"}

        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";") if s]
        for i, shape in enumerate(shapes):
            log(f"case E,N,K = {shape}")
            try:
                case = run_case(shape, layout, fns, dt, args.device, args.seed + i)
                rep.data["cases"].append(case)
            except Exception as exc:  # noqa: BLE001
                rep.data["cases"].append({"shape": shape, "error": f"{type(exc).__name__}: {exc}",
                                          "traceback": traceback.format_exc()})
                log(f"  case {shape} FAILED: {type(exc).__name__}: {exc}")
        text, ok = verdict(rep.data["cases"])
        rep.data["verdict"] = text
        log(text)
        status = 0 if ok else 1
        return status
    except BaseException as exc:  # noqa: BLE001 - never leave without a report
        rep.step("unexpected error", False, error=f"{type(exc).__name__}: {exc}",
                 traceback=traceback.format_exc())
        return status
    finally:
        rep.data["exit_status"] = status
        try:
            rep.write(Path(args.out))
        except Exception as exc:  # noqa: BLE001
            log(f"could not write {args.out}: {exc}")
            log(json.dumps(rep.data, default=str)[:4000])


if __name__ == "__main__":
    sys.exit(main())
