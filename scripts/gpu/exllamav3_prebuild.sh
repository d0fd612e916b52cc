#!/usr/bin/env bash
# Builds, here, the tiny Hugging Face models of the families the GPU machine's transformers (5.17)
# cannot build (exllamav3_fixtures.PREBUILT_FAMILIES: GLM-5.3 and Qwen4-Exp came with 5.25) into
# CHECKOUT/.exl3v3-hf/models.tar.xz (git-ignored), which exllamav3_run.sh unpacks and uses
# instead of building those families on the machine. Carry .exl3v3-hf with .exl3v3-b on call 2.
#
#   scripts/gpu/exllamav3_prebuild.sh CHECKOUT     (HF_PYTHON: a Python with transformers >= 5.25)
set -euo pipefail
CHECKOUT=${1:?usage: exllamav3_prebuild.sh CHECKOUT}
CHECKOUT=$(cd "$CHECKOUT" && pwd)
PY=${HF_PYTHON:-/opt/hfref/bin/python}
H="$CHECKOUT/.exl3v3-hf"
# The models are tiny; Qwen4-Exp's n-gram table (four heads of >= 8192 rows of 160 in bf16,
# 10.5 MB: exllamav3_fixtures.EXL3V3_CHANGES) is most of the tar. A bigger one means something
# else went in.
LIMIT=16777216

if ! git -C "$CHECKOUT" check-ignore -q .exl3v3-hf/x; then
  echo "exllamav3_prebuild: .exl3v3-hf is not git-ignored in $CHECKOUT (its .gitignore needs /.exl3v3-hf/)" >&2
  exit 1
fi
FIX="$CHECKOUT/scripts/conformance/exllamav3_fixtures.py"
families=$("$PY" -c "import sys; sys.path.insert(0, '$(dirname "$FIX")'); import exllamav3_fixtures as x; print(','.join(x.PREBUILT_FAMILIES))")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
echo "exllamav3_prebuild: building $families with $("$PY" -c 'import transformers; print("transformers", transformers.__version__)')" >&2
"$PY" "$FIX" models --families "$families" --out "$TMP/prebuilt"
rm -rf "$H"
mkdir -p "$H"
# xz -9e: bf16 weights shrink by a quarter, and GLM-5.3's MTP layer (a copy of a decoder layer)
# to nothing.
tar -C "$TMP" -cf - prebuilt | xz -9e -T2 > "$H/models.tar.xz"
size=$(stat -c %s "$H/models.tar.xz")
ls -l "$H"
if [ "$size" -ge $LIMIT ]; then
  echo "exllamav3_prebuild: $H/models.tar.xz is $size bytes, over $LIMIT" >&2
  exit 1
fi
echo "exllamav3_prebuild: $size bytes; carry \".exl3v3-hf\" on device call 2 (exllamav3_run.sh)"
