#!/usr/bin/env bash
# On the GPU machine (repository root, the bundle carried: scripts/gpu/bundle.sh): where one decode
# step's GPU time goes, kernel by kernel, under Nsight Compute (ncu; the machine has no nsys).
#  1. makes a model of GLM-4.5-Air's shapes (dense intermediate 11008: 10944 is no multiple of 128)
#     with LAYERS layers (default 4: the first dense) unless
#     MODEL exists;
#  2. runs `exl3-engine-bench --no-graphs --steps 1` at each BATCH (default 1) and CONTEXT under ncu,
#     timing every kernel (gpu__time_duration, each kernel replayed alone, L2 not flushed between
#     them: closer to the step than ncu's default), and prints the kernels of the last decode step
#     (those after the last embedding gather) grouped by name: count, total µs, share; with
#     PHASE=prefill those of the longest forward pass instead (from one embedding gather to the
#     next: at batch 1 a prefill chunk of the CONTEXT-token prompt); PHASE="decode prefill" gives
#     both from the one ncu run, into profile-B<batch>-<phase>.txt;
#  3. with DETAIL=1 also profiles one decode-attention launch in full (stall reasons, memory
#     throughput) into $OUT/attention-detail.txt.
# Writes $OUT/profile-B<batch>.csv (ncu's raw rows) and $OUT/profile-B<batch>.txt (the summary).
# Env: MODEL (default /tmp/air-profile), LAYERS, BATCH (comma list), CONTEXT (default 1024), PHASE
# (decode, the default, prefill, or both space-separated), DETAIL.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/air-profile}
LAYERS=${LAYERS:-4}
CONTEXT=${CONTEXT:-1024}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ ! -f "$MODEL/config.json" ]; then
  "$BIN/exl3-tool" make-test-model --arch glm4_moe --synthetic --whole-model --output "$MODEL" \
    --hidden 4096 --experts 128 --top-k 8 --intermediate 1408 --shared 1 --layers "$LAYERS" \
    --dense-layers 1 --dense-intermediate 11008 --vocab 151552 --heads 96 --kv-heads 8 --head-dim 128 \
    --bits 2 --attention-bits 4 --head-bits 6 --codebook mcg --max-position 16384 --quiet
fi
for B in ${BATCH:-1} ; do
  B=${B//,/ }
  for b in $B; do
    csv=$OUT/profile-B$b.csv
    "$NCU" --metrics gpu__time_duration.sum --cache-control none --csv --page raw \
      "$BIN/exl3-engine-bench" --model "$MODEL" --context "$CONTEXT" --batch "$b" --steps 1 --no-graphs \
      > "$csv" 2> "$OUT/profile-B$b.log" || { tail -20 "$OUT/profile-B$b.log"; exit 1; }
    PHASES=(${PHASE:-decode})
    for phase in "${PHASES[@]}"; do
    summary=$OUT/profile-B$b.txt
    [ "${#PHASES[@]}" -gt 1 ] && summary=$OUT/profile-B$b-$phase.txt
    python3 - "$csv" "$b" "$phase" > "$summary" <<'EOF'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
cols = rows[head]
name_i, time_i = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum")
kernels = []
for r in rows[head + 1:]:
    try:
        kernels.append((r[name_i], float(r[time_i].replace(",", ""))))
    except (ValueError, IndexError):
        continue  # the units row
starts = [i for i, (n, _) in enumerate(kernels) if "EmbedKernel" in n]
passes = [kernels[a:b] for a, b in zip(starts, starts[1:] + [len(kernels)])]
phase = sys.argv[3]
step = passes[-1] if phase == "decode" else max(passes, key=lambda p: sum(t for _, t in p))
unit = rows[head + 1][time_i]  # the units row
scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit, 1e-3)
step = [(n, t * scale) for n, t in step]
total = sum(t for _, t in step)
by = collections.OrderedDict()
for n, t in step:
    # Kernels in anonymous namespaces read "engine::<unnamed>::Name<...>(...)": drop that first.
    short = n.replace("<unnamed>::", "").replace("(anonymous namespace)::", "")
    short = short.split("(")[0].split("<")[0].replace("void ", "")
    c, s = by.get(short, (0, 0.0))
    by[short] = (c + 1, s + t)
what = "the last decode step" if phase == "decode" else "the longest forward pass (prefill)"
print(f"batch {sys.argv[2]}: {len(step)} kernels in {what}, {total:.1f} us")
for n, (c, s) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    print(f"{s:9.1f} us {100 * s / total:5.1f} %  x{c:<4d} {s / c:7.2f} us each  {n}")
EOF
    cat "$summary"
    done
  done
done
if [ "${DETAIL:-0}" = 1 ]; then
  "$NCU" --set full -k regex:TensorCoreAttention --launch-skip 3 --launch-count 1 \
    "$BIN/exl3-engine-bench" --attention-only --context "$CONTEXT" --batch 1 --runs 5 \
    > "$OUT/attention-detail.txt" 2>&1 || tail -20 "$OUT/attention-detail.txt"
  grep -E "Duration|Throughput|Stall|Warp Cycles|Achieved Occupancy|Registers|Issued" "$OUT/attention-detail.txt" | head -60
fi
