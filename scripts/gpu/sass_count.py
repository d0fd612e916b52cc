#!/usr/bin/env python3
"""Counts SASS instructions in the loop body of each DecodeCeilingKernel<K, CB> (sm_90) of a binary:
the loop decodes 4 tiles per iteration, i.e. 32 weights per thread, so instructions per weight =
loop instructions / 32. Usage: sass_count.py BINARY"""
import re
import subprocess
import sys

out = subprocess.run(["cuobjdump", "--dump-sass", "--gpu-architecture", "sm_90", sys.argv[1]],
                     capture_output=True, text=True).stdout
funcs = re.split(r"\n\s*Function : ", out)
print("decode loop SASS (sm_90): instructions per weight, by kind")
for f in funcs[1:]:
    name = f.split("\n", 1)[0].strip()
    m = re.search(r"DecodeCeilingKernelILi(\d)ELi(\d)E", name)
    if not m:
        continue
    K, cb = int(m.group(1)), int(m.group(2))
    # Instructions with addresses, and label -> address of the next instruction.
    addr, labels, pending = [], {}, []
    for line in f.split("\n"):
        lm = re.match(r"\s*(\.L_x_\d+):", line)
        if lm:
            pending.append(lm.group(1))
            continue
        im = re.search(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
        if im:
            a = int(im.group(1), 16)
            for p in pending:
                labels[p] = a
            pending = []
            addr.append((a, im.group(2).strip()))
    best = None
    for a, t in addr:
        if "BRA" not in t:
            continue
        lm = re.search(r"(\.L_x_\d+)", t)
        hm = re.search(r"0x([0-9a-f]+)", t)
        ta = labels.get(lm.group(1)) if lm else (int(hm.group(1), 16) if hm else None)
        if ta is not None and ta < a and (best is None or a - ta > best[1] - best[0]):
            best = (ta, a)
    if best is None:
        print(f"K={K} cb={cb}: loop not found")
        continue
    body = [t for a, t in addr if best[0] <= a <= best[1]]
    kinds = {}
    for t in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
        kinds[op] = kinds.get(op, 0) + 1
    top = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda x: -x[1])[:9])
    print(f"K={K} cb={['3inst','mcg','mul1'][cb]}: {len(body)} instructions / 32 weights = "
          f"{len(body)/32:.2f} per weight  [{top}]")
