#!/usr/bin/env python3
"""A model too deep for the machine, timed at two depths and extrapolated per layer.

    scripts/gpu/depth_extrapolation.py --layers 45 6:glm5-L6.json 10:glm5-L10.json

Each input is `exl3-engine-bench --json FILE` of the same model family and shapes at LAYERS layers
(the same dense layers first, so the two differ only by MoE layers in the family's pattern of
attention kinds). For every (context, batch) of decode and every context of prefill that both
have, a step's time and its floor are taken as linear in the depth: per layer
(t_b - t_a) / (L_b - L_a), carried from the deeper run to --layers. Prints a markdown table (the
measured steps, the per-layer slope, the extrapolated step, tokens/s and the ratio to the
extrapolated floor). The slope is exact only where the added layers repeat whole periods of the
attention pattern (GLM-5.3-Flash: one MLA layer in four); the table says how many layers it
carries, so a reader can judge that."""
import argparse
import json
import sys


def load(spec):
    """'LAYERS:FILE' -> (layers, {key: record}) for the engine_decode and engine_prefill records."""
    layers, _, path = spec.partition(":")
    if not path:
        sys.exit(f"depth_extrapolation: '{spec}' is not LAYERS:FILE")
    records = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            if r.get("bench") == "engine_decode":
                records[("decode", r["experts"], r["context"], r["batch"])] = r
            elif r.get("bench") == "engine_prefill":
                records[("prefill", r["experts"], r["context"], 1)] = r
    return int(layers), records


def extrapolate(a_layers, a, b_layers, b, layers):
    """Rows of the extrapolated table, one per key both runs have, in decode-then-prefill order."""
    if a_layers == b_layers:
        sys.exit("depth_extrapolation: the two runs must differ in depth")
    if a_layers > b_layers:
        a_layers, a, b_layers, b = b_layers, b, a_layers, a
    rows = []
    for key in sorted(set(a) & set(b), key=lambda k: (k[0] != "decode", k[1], k[2], k[3])):
        kind, experts, context, batch = key
        field = "step_s" if kind == "decode" else "ttft_s"
        ta, tb = a[key][field], b[key][field]
        per_layer = (tb - ta) / (b_layers - a_layers)
        t = tb + per_layer * (layers - b_layers)
        fa, fb = a[key].get("floor_s", 0.0), b[key].get("floor_s", 0.0)
        floor = fb + (fb - fa) / (b_layers - a_layers) * (layers - b_layers) if fa > 0 and fb > 0 else None
        rows.append({"kind": kind, "experts": experts, "context": context, "batch": batch,
                     "measured_s": (ta, tb), "per_layer_s": per_layer, "step_s": t,
                     "tokens_per_s": (batch / t if kind == "decode" else context / t),
                     "floor_s": floor, "over_floor": (t / floor if floor else None)})
    return rows


def table(rows, a_layers, b_layers, layers):
    out = [f"Extrapolated from {a_layers} and {b_layers} layers to {layers} "
           f"(+{layers - max(a_layers, b_layers)} layers at the per-layer slope):", "",
           f"| step | experts | context | batch | {a_layers} layers | {b_layers} layers | per layer | "
           f"{layers} layers | tokens/s | / floor |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ta, tb = r["measured_s"]
        ratio = f"{r['over_floor']:.2f}x" if r["over_floor"] else "not modelled"
        out.append(f"| {r['kind']} | {r['experts']} | {r['context']} | {r['batch']} | {ta * 1e3:.3f} ms | "
                   f"{tb * 1e3:.3f} ms | {r['per_layer_s'] * 1e3:.3f} ms | {r['step_s'] * 1e3:.3f} ms | "
                   f"{r['tokens_per_s']:.1f} | {ratio} |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, required=True, help="the depth to extrapolate to")
    p.add_argument("runs", nargs=2, metavar="LAYERS:FILE", help="exl3-engine-bench --json output at a depth")
    args = p.parse_args(argv)
    (a_layers, a), (b_layers, b) = (load(s) for s in args.runs)
    rows = extrapolate(a_layers, a, b_layers, b, args.layers)
    if not rows:
        sys.exit("depth_extrapolation: the two runs share no (context, batch)")
    print(table(rows, min(a_layers, b_layers), max(a_layers, b_layers), args.layers))


if __name__ == "__main__":
    main()
