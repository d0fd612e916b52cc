#!/usr/bin/env bash
# Side by side on one GPU, in one device call: exl3-engine-bench and exllamav3 1.6.5's own generator
# (scripts/gpu/exllamav3_bench.py) on the same model directory: time to first token and decode
# tokens/s at each batch and context. Carry .gpu-check (scripts/gpu/bundle.sh), .exl3v3-a and
# .exl3v3-b (scripts/gpu/exllamav3_stage.sh); the tracked tree must leave room for them (64 MiB a
# call: `scripts/dev/fixtures_aside.sh out` sets every fixture aside for the call, none of which
# it reads; `in` brings them back).
#   bash scripts/gpu/exllamav3_bench.sh
# Environment: FAMILY (glm4_moe: GLM-4.5-Air shapes, scripts/gpu/glm45_air_model.sh, the default;
# glm5_next: GLM-5.3-Flash shapes, scripts/gpu/glm5_next_model.sh; qwen4_exp: Qwen3.8-Flash-Next
# shapes, scripts/gpu/qwen4_exp_model.sh), LAYERS (default 8), CONTEXTS (1024,8192), BATCHES (1,8,32,64), STEPS (16).
# $OUT: side-by-side.json (one object per result, both engines), side-by-side.md (the table) and
# logs.tar.xz.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
trap '(cd "$OUT" && ls ./*.log > /dev/null 2>&1 && tar -cJf logs.tar.xz ./*.log && rm -f ./*.log)' EXIT
exec > >(tee "$OUT/side-by-side.log") 2>&1
FAMILY=${FAMILY:-glm4_moe} LAYERS=${LAYERS:-8} CONTEXTS=${CONTEXTS:-1024,8192} BATCHES=${BATCHES:-1,8,32,64} STEPS=${STEPS:-16}
say() { echo "exllamav3_bench: [$SECONDS s] $*"; }

. scripts/gpu/exllamav3_ready.sh
exllamav3_ready || exit 2
source scripts/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
git log -1 --format='commit %H' 2>/dev/null || true

case "$FAMILY" in
  glm4_moe)
    MODEL=/tmp/glm45-air-synthetic-$LAYERS
    say "model: GLM-4.5-Air shapes, $LAYERS layers"
    bash scripts/gpu/glm45_air_model.sh "$BIN" "$MODEL" "$LAYERS" "$OUT/model.log" || exit 3 ;;
  glm5_next)
    MODEL=/tmp/glm5-next-synthetic-$LAYERS
    say "model: GLM-5.3-Flash shapes, $LAYERS layers (release config layout)"
    bash scripts/gpu/glm5_next_model.sh "$BIN" "$MODEL" "$LAYERS" "$OUT/model.log" || exit 3 ;;
  qwen4_exp)
    MODEL=/tmp/qwen4-exp-synthetic-$LAYERS
    say "model: Qwen3.8-Flash-Next shapes, $LAYERS layers (release config layout)"
    bash scripts/gpu/qwen4_exp_model.sh "$BIN" "$MODEL" "$LAYERS" "$OUT/model.log" || exit 3 ;;
  *) say "FAMILY must be glm4_moe, glm5_next or qwen4_exp, got $FAMILY"; exit 2 ;;
esac
# exllamav3's generator needs a tokenizer; the timings use random ids and never decode text.
[ -f "$MODEL/tokenizer.json" ] || PYTHONPATH=clients/python:$PYTHONPATH python3 -m exl3serve_client.make_tokenizer \
  --model "$MODEL" > "$OUT/tokenizer.log" 2>&1 || { say "tokenizer failed"; tail -5 "$OUT/tokenizer.log"; }

rm -f "$OUT/side-by-side.json"
say "exl3-engine-bench"
timeout 240 "$BIN"/exl3-engine-bench --model "$MODEL" --context "$CONTEXTS" --batch "$BATCHES" --steps "$STEPS" \
  --json "$OUT/side-by-side.json" > "$OUT/engine-bench.log" 2>&1
say "exl3-engine-bench exit $?"
grep -E "^(decode|prefill|time to first|TTFT)|floor" "$OUT/engine-bench.log" | head -30
say "exllamav3"
timeout 300 python3 scripts/gpu/exllamav3_bench.py --model "$MODEL" --context "$CONTEXTS" --batch "$BATCHES" \
  --steps "$STEPS" --json "$OUT/side-by-side.json" > "$OUT/exllamav3-bench.log" 2>&1
say "exllamav3 exit $?"
tail -n 20 "$OUT/exllamav3-bench.log"
python3 scripts/gpu/side_by_side_table.py "$OUT/side-by-side.json" > "$OUT/side-by-side.md" && cat "$OUT/side-by-side.md"
