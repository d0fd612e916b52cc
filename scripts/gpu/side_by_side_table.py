"""The side-by-side table (markdown) from the JSON lines exl3-engine-bench and
scripts/gpu/exllamav3_bench.py append to one file (scripts/gpu/exllamav3_bench.sh).

    python3 side_by_side_table.py side-by-side.json
"""

import json
import sys


def main() -> int:
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    engine_ttft = {r["context"]: r["ttft_s"] for r in rows if r.get("bench") == "engine_prefill"}
    exl3_ttft = {r["context"]: r["ttft_s"] for r in rows if r.get("bench") == "exllamav3_prefill"}
    engine = {(r["context"], r["batch"]): r for r in rows
              if r.get("bench") == "engine_decode" and r.get("graphs", True)}
    exl3 = {(r["context"], r["batch"]): r for r in rows if r.get("bench") == "exllamav3_decode"}
    fmt = lambda v, f: f.format(v) if v is not None else "-"
    print("| context | time to first token: engine | exllamav3 | exllamav3 / engine |")
    print("|---:|---:|---:|---:|")
    for ctx in sorted(set(engine_ttft) | set(exl3_ttft)):
        a, b = engine_ttft.get(ctx), exl3_ttft.get(ctx)
        print(f"| {ctx} | {fmt(a and a * 1e3, '{:.1f} ms')} | {fmt(b and b * 1e3, '{:.1f} ms')} | "
              f"{fmt(a and b and b / a, '{:.2f}x')} |")
    print()
    print("| context | batch | engine tokens/s | (x floor) | exllamav3 tokens/s | engine / exllamav3 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for key in sorted(set(engine) | set(exl3)):
        a, b = engine.get(key), exl3.get(key)
        ta = a and a["tokens_per_s"]
        tb = b and b["tokens_per_s"]
        floor = a and a.get("floor_s") and a["step_s"] / a["floor_s"]
        print(f"| {key[0]} | {key[1]} | {fmt(ta, '{:.1f}')} | {fmt(floor, '{:.2f}x')} | {fmt(tb, '{:.1f}')} | "
              f"{fmt(ta and tb and ta / tb, '{:.2f}x')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
