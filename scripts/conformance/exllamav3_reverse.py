"""The reverse check (issue: exllamav3 as judge): exllamav3 loads the model directories that
`exl3-tool quantize` wrote (tests/fixtures/engine/FAMILY_VARIANT) and its logits are compared with
the fixture's reference logits (transformers on the same EXL3 weights dequantized: the logits the
engine is held to), prompt by prompt.

    python3 exllamav3_reverse.py --fixtures tests/fixtures/engine --names glm4_moe_all,... --out FILE.json

On the GPU machine, with exllamav3 importable (scripts/gpu/exllamav3_reverse.sh). For each
directory: exllamav3's Config / Model load it onto cuda:0, and one forward pass without a cache
(attn_mode flash_attn_nc, as scripts/conformance/exllamav3_fixtures.py records exllamav3's own
logits) over each prompt + transformers' greedy continuation gives fp32 logits, compared row by row
with reference.safetensors' `logits.i` (‖out − ref‖ / ‖ref‖ per row, the worst row reported) and
by argmax over the greedy rows. A directory exllamav3 refuses is reported with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback


def log(msg: str) -> None:
    print(f"exllamav3_reverse: {msg}", flush=True)


def check(directory: str) -> dict:
    import torch
    from safetensors import safe_open
    from exllamav3 import Config, Model

    ref = safe_open(os.path.join(directory, "reference.safetensors"), "pt")
    with open(os.path.join(directory, "reference.json")) as f:
        meta = json.load(f)
    config = Config.from_directory(directory)
    model = Model.from_config(config)
    model.load("cuda:0")
    out = {"architecture": config.architecture, "prompts": []}
    try:
        for p in meta["prompts"]:
            i = p["index"]
            prompt = ref.get_tensor(f"prompt.{i}").long()
            greedy = ref.get_tensor(f"greedy.{i}").long()
            want = ref.get_tensor(f"logits.{i}").float()
            ids = torch.cat([prompt, greedy]).view(1, -1)
            got = model.forward(ids, {"attn_mode": "flash_attn_nc"}).float().cpu()[0]
            got = got[: want.shape[0], : want.shape[1]]
            rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).tolist()
            steps = slice(prompt.numel() - 1, prompt.numel() - 1 + greedy.numel())
            same = (got[steps].argmax(-1) == want[steps].argmax(-1)).sum().item()
            out["prompts"].append({"index": i, "rows": len(rel), "worst_row_rel": max(rel),
                                   "mean_row_rel": sum(rel) / len(rel),
                                   "greedy_argmax_same": same, "greedy_rows": greedy.numel()})
    finally:
        model.unload()
        del model
        torch.cuda.empty_cache()
    out["worst_row_rel"] = max(p["worst_row_rel"] for p in out["prompts"])
    out["greedy_argmax_same"] = sum(p["greedy_argmax_same"] for p in out["prompts"])
    out["greedy_rows"] = sum(p["greedy_rows"] for p in out["prompts"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", default="tests/fixtures/engine")
    ap.add_argument("--names", required=True, help="comma-separated fixture directories")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = {}
    try:
        from exllamav3.version import __version__ as version
    except Exception:
        version = "unknown"
    for name in args.names.split(","):
        try:
            r = check(os.path.join(args.fixtures, name))
            results[name] = r
            log(f"{name}: {r['architecture']}: worst row rel {r['worst_row_rel']:.2e}, greedy argmax "
                f"{r['greedy_argmax_same']}/{r['greedy_rows']}")
        except Exception as e:
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{name}: refused or failed: {type(e).__name__}: {e}")
        with open(args.out, "w") as f:
            json.dump({"exllamav3": version, "fixtures": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
