#!/usr/bin/env bash
# Device call 1 of 2 (scripts/gpu/exllamav3_stage.sh prints both): installs exllamav3 1.6.5 and
# its prebuilt extension from .exl3v3-a/ into /tmp/site, which call 2 (exllamav3_run.sh) uses on
# the same warm machine. Writes $OUT/install.log.
set -uo pipefail
SITE=${EXL3V3_SITE:-/tmp/site}
A=.exl3v3-a
OUT=${OUT:-/tmp/exl3v3-out}
mkdir -p "$OUT"
LOG="$OUT/install.log"
exec > >(tee "$LOG") 2>&1
say() { echo "exllamav3_install: $*"; }

[ -d "$A" ] || { say "no $A: carry it (scripts/gpu/exllamav3_stage.sh)"; exit 2; }
if [ -f "$SITE/exllamav3_ext.so" ] && [ -d "$SITE/exllamav3" ]; then
  # Unpacking again would give the sources new times (a rebuild if the .so is not used).
  say "$SITE already holds exllamav3: leaving it"
else
  rm -rf "$SITE"
  mkdir -p "$SITE"
  say "unpacking exllamav3 into $SITE"
  tar -C "$SITE" -xJf "$A"/exllamav3-1.6.5.tar.xz || { say "unpacking failed"; exit 3; }
  say "unpacking the extension"
  xz -dc "$A"/exllamav3_ext-*.so.xz > "$SITE/exllamav3_ext.so" || { say "extension unpack failed"; exit 3; }
fi
ls -la "$SITE"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
python3 - <<PY
import sys, time
sys.path.insert(0, "$SITE")
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
try:
    print("device", torch.cuda.get_device_name(0))
except Exception as e:
    print("no CUDA device:", repr(e))
try:
    import transformers
    print("transformers", transformers.__version__)
except Exception as e:
    print("transformers: import failed:", repr(e))
t = time.time()
try:
    import exllamav3_ext
    print("exllamav3_ext: loaded from", exllamav3_ext.__file__, f"({time.time() - t:.1f} s)")
except Exception as e:
    print("exllamav3_ext: does NOT load:", repr(e))
    print("call 2 will then build it from the sources (about 5 minutes on 16 cores)")
for m in ("pydantic", "PIL", "marisa_trie", "triton", "rich", "tokenizers", "safetensors", "tqdm", "psutil"):
    try:
        __import__(m)
        print(m, "present")
    except Exception as e:
        print(m, "missing:", type(e).__name__)
PY
say "done"
