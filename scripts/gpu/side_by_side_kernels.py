#!/usr/bin/env python3
"""exl3-bench's kernel timings and exllamav3 1.6.5's at the same cases in one Markdown table per
kind, rows named and ordered as bench/results/h200.md's (scripts/gpu/exllamav3_kernels.sh makes both
inputs in one device call).

    python3 side_by_side_kernels.py --exl3-bench bench-gemv.json bench-moe.json bench-gemm.json \\
        --exllamav3 exllamav3-kernels.json [--md FILE]

--exl3-bench: `exl3-bench gemv|moe|gemm --json FILE` outputs (a JSON array each); --exllamav3:
scripts/gpu/exllamav3_kernels.py --json (JSON lines). Either form is read from either. Ours is
exl3-bench's native path (GEMV: the path LinearForward chose, 1L / 3L / G; MoE: the better of the
forced chain and the cooperative decode where it covers T), exllamav3's the best path that passed
its check (exllamav3_kernels.py names it); the last column is exllamav3 / ours, above 1 where ours
is faster. A row one side lacks shows "-" there; notes list MoE rows whose routing differs
(experts touched) and exllamav3 errors or failed checks.
"""
import argparse
import json
import sys

import exllamav3_kernels as xk


def load_records(path):
    """A JSON array, one JSON object, or JSON lines."""
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        pass
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        sys.exit(f"side_by_side_kernels: {path}: neither JSON nor JSON lines ({e})")


def _ratio(a, b):
    return a / b if a is not None and b else None


def _exllamav3_side(rec):
    """(best µs, its path label, notes) of an exllamav3_kernels record, or Nones."""
    if rec is None:
        return None, None, []
    notes = [f"exllamav3: {rec['error']}"] if rec.get("error") else []
    for name, p in rec["paths"].items():
        if p.get("error"):
            notes.append(f"exllamav3 {name}: {p['error']}")
        elif p.get("ok") is False:
            err = p.get("rel_err")
            notes.append(f"exllamav3 {name} failed its check (rel. error {'not finite' if err is None else f'{err:.1e}'})")
    return rec.get("best_us"), (xk.best_label(rec) if rec.get("best_path") else None), notes


def merge(ours, theirs):
    """Rows per kind ("gemv", "moe", "gemm") in exllamav3_kernels' case order, each case either
    side has."""
    o_gemv = {(r["m"], r["k"], r["n"], r["K"], r["codebook"]): r for r in ours if r.get("bench") == "gemv"}
    o_moe = {(r["model"], r["K"], r["codebook"], r["T"]): r for r in ours if r.get("bench") == "moe"}
    o_gemm = {(r["m"], r["k"], r["n"], r["K"], "mcg"): r for r in ours if r.get("bench") == "gemm"}
    t_lin = {(r["m"], r["k"], r["n"], r["K"], r["codebook"]): r for r in theirs
             if r.get("bench") in ("exllamav3_gemv", "exllamav3_gemm")}
    t_moe = {(r["model"], r["K"], r["codebook"], r["T"]): r for r in theirs if r.get("bench") == "exllamav3_moe"}

    def linear_rows(cases, o):
        rows = []
        for c in cases:
            key = (c.m, c.k, c.n, c.K, c.codebook)
            a, b = o.get(key), t_lin.get(key)
            if a is None and b is None:
                continue
            us, path, notes = _exllamav3_side(b)
            native = a and a["native_us"]
            rows.append({"case": c.name, "native_us": native, "floor_us": a and a.get("floor_us"),
                         "reference_us": a and a.get("reference_us"),
                         "native_path": a and {1: "1L", 3: "3L"}.get(a.get("launches"), "G"),
                         "exllamav3_us": us, "exllamav3_path": path, "ratio": _ratio(us, native), "notes": notes})
        return rows

    moe = []
    for c in xk.moe_cases():
        key = (c.shape.model, c.K, c.codebook, c.T)
        a, b = o_moe.get(key), t_moe.get(key)
        if a is None and b is None:
            continue
        us, path, notes = _exllamav3_side(b)
        ours_us = None
        if a:
            ours_us = min(v for v in (a["native_us"], a.get("coop_us")) if v is not None)
        ta, tb = a and a.get("experts_touched"), b and b.get("experts_touched")
        if ta is not None and tb is not None and abs(ta - tb) > 0.005:
            notes.append(f"experts touched: exl3-bench {ta:.2f}, exllamav3_kernels {tb:.2f}")
        moe.append({"layer": c.layer, "T": c.T, "experts": ta if ta is not None else tb,
                    "native_us": a and a["native_us"], "coop_us": a and a.get("coop_us"), "ours_us": ours_us,
                    "floor_us": a and a.get("floor_us"), "exllamav3_us": us, "exllamav3_path": path,
                    "ratio": _ratio(us, ours_us), "notes": notes})
    return {"gemv": linear_rows(xk.gemv_cases(), o_gemv), "moe": moe, "gemm": linear_rows(xk.gemm_cases(), o_gemm)}


def _f(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


def _x(v):
    return _f(v, "{:.2f}\u00d7")


def format_markdown(merged, device=None):
    lines = ["## EXL3 kernels: exl3-bench and exllamav3 1.6.5 on the same GPU, \u00b5s per call", ""]
    if device:
        lines += [f"exllamav3 {device['exllamav3']} on {device['device']} ({device['sms']} SMs), "
                  f"torch {device['torch']}, EXL3_INT8_GEMV={device['int8_gemv']}.", ""]
    tables = (
        ("gemv", "GEMV and decode-sized GEMM",
         ("case", "native", "floor", "\u00d7 floor", "exllamav3 1.6.5", "its path", "exllamav3 \u00f7 native"),
         lambda r: [r["case"], f"{_f(r['native_us'])} ({r['native_path']})" if r["native_us"] is not None else "-",
                    _f(r["floor_us"]), _x(_ratio(r["native_us"], r["floor_us"])), _f(r["exllamav3_us"]),
                    r["exllamav3_path"] or "-", _x(r["ratio"])]),
        ("moe", "MoE layer decode (routed top-k + shared expert)",
         ("layer", "T", "experts", "native (chain)", "coop", "floor", "exllamav3 1.6.5", "its path",
          "exllamav3 \u00f7 ours"),
         lambda r: [r["layer"], str(r["T"]), _f(r["experts"]), _f(r["native_us"]), _f(r["coop_us"]),
                    _f(r["floor_us"]), _f(r["exllamav3_us"]), r["exllamav3_path"] or "-", _x(r["ratio"])]),
        ("gemm", "Prefill GEMM",
         ("case", "native", "reference", "exllamav3 1.6.5", "its path", "exllamav3 \u00f7 native"),
         lambda r: [r["case"], _f(r["native_us"]), _f(r["reference_us"]), _f(r["exllamav3_us"]),
                    r["exllamav3_path"] or "-", _x(r["ratio"])]),
    )
    notes = []
    for kind, title, head, cells in tables:
        rows = merged[kind]
        if not rows:
            continue
        lines += [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            lines.append("| " + " | ".join(cells(r)) + " |")
            label = r.get("case") or f"{r['layer']} T={r['T']}"
            notes += [f"- {label}: {n}" for n in r["notes"]]
        lines.append("")
    if notes:
        lines += ["Notes:", ""] + notes + [""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exl3-bench", nargs="+", default=[], help="exl3-bench --json outputs")
    ap.add_argument("--exllamav3", required=True, help="exllamav3_kernels.py --json output")
    ap.add_argument("--md", help="also write the table here")
    args = ap.parse_args()
    ours = [r for path in args.exl3_bench for r in load_records(path)]
    theirs = load_records(args.exllamav3)
    device = next((r for r in theirs if r.get("bench") == "exllamav3_device"), None)
    md = format_markdown(merge(ours, theirs), device)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
