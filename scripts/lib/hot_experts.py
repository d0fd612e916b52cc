#!/usr/bin/env python3
"""Finds the most-routed experts of an EXL3 MoE model by routing random hidden states through
`exl3-tool moe` for every MoE layer, and prints them as a comma-separated list.

usage: hot_experts.py EXL3_TOOL MODEL_DIR WORK_DIR COUNT
"""
import json
import os
import struct
import random
import subprocess
import sys


def write_f32(path, name, rows, cols, values):
    """Writes one fp32 tensor [rows, cols] as a safetensors file (standard library only)."""
    data = struct.pack("<%df" % len(values), *values)
    header = {name: {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, len(data)]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def read_i32(path, name):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(n))[name]
        assert info["dtype"] == "I32", info
        begin, end = info["data_offsets"]
        f.seek(8 + n + begin)
        raw = f.read(end - begin)
    return struct.unpack("<%di" % (len(raw) // 4), raw)


def main():
    tool, model, work, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    hidden = cfg["hidden_size"]
    layers = cfg["num_hidden_layers"]
    first_dense = cfg.get("first_k_dense_replace", 0)
    rng = random.Random(7)
    tokens = 64
    xpath = os.path.join(work, "hot_x.safetensors")
    ypath = os.path.join(work, "hot_y.safetensors")
    write_f32(xpath, "x", tokens, hidden, [rng.gauss(0, 1) for _ in range(tokens * hidden)])
    counts = {}
    for layer in range(first_dense, layers):
        subprocess.run([tool, "moe", "--model", model, "--layer", str(layer), "--x", xpath,
                        "--output", ypath, "--backend", "cpu"], check=True,
                       stdout=subprocess.DEVNULL)
        for e in read_i32(ypath, "topk_ids"):
            counts[e] = counts.get(e, 0) + 1
    hot = sorted(counts, key=lambda e: (-counts[e], e))[:count]
    print(",".join(str(e) for e in sorted(hot)))


if __name__ == "__main__":
    main()
