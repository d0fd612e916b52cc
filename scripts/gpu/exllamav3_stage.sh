#!/usr/bin/env bash
# Stages the two device calls that convert tiny models with exllamav3 and record its tokens and
# logits (scripts/conformance/exllamav3_fixtures.py, tests/fixtures/exllamav3/README.md).
#
#   scripts/gpu/exllamav3_stage.sh CHECKOUT     (CHECKOUT: the tree the device call sends, e.g. /work/main)
#
# Fills two git-ignored folders of CHECKOUT and prints their sizes and the two device calls:
#   .exl3v3-a/  call 1: exllamav3 1.6.5 (its wheel's files as one tar.xz) and the prebuilt extension
#   .exl3v3-b/  call 2: the wheels exllamav3 imports that the GPU machine lacks (pydantic and its
#               dependencies, Pillow (every architecture module is imported, DeepSeek-V4's vision
#               one needs PIL), marisa-trie)
# The tiny Hugging Face models are built on the GPU machine (transformers 5.17 there writes the
# same bytes as 5.25 here), so nothing else travels.
set -euo pipefail
CHECKOUT=${1:?usage: exllamav3_stage.sh CHECKOUT}
CHECKOUT=$(cd "$CHECKOUT" && pwd)
SHARED=${EXLLAMAV3_DIR:-/work/shared/exllamav3}
PY=${PYTHON:-python3}
LIMIT=67108864  # what one device call may carry: tracked files + carried paths
A="$CHECKOUT/.exl3v3-a"
B="$CHECKOUT/.exl3v3-b"

for d in .exl3v3-a .exl3v3-b; do
  if ! git -C "$CHECKOUT" check-ignore -q "$d/x"; then
    echo "exllamav3_stage: $d is not git-ignored in $CHECKOUT (its .gitignore needs /$d/)" >&2
    exit 1
  fi
done

rm -rf "$A" "$B"
mkdir -p "$A" "$B"
echo "exllamav3_stage: packing exllamav3 into $A" >&2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && unzip -q "$SHARED"/exllamav3-1.6.5-py3-none-any.whl)
# One tar.xz instead of the wheel: 2.6 MB instead of 3.8, so it fits beside the extension.
tar -C "$TMP" -cf - exllamav3 exllamav3-1.6.5.dist-info | xz -9e -T2 > "$A/exllamav3-1.6.5.tar.xz"
cp "$SHARED"/exllamav3_ext-torch2.11.0-cu130-sm90-py312.so.xz "$A/"

echo "exllamav3_stage: collecting wheels into $B" >&2
for w in pydantic-2 pydantic_core- annotated_types- typing_inspection- marisa_trie-; do
  cp "$SHARED"/$w*.whl "$B/"
done
PILLOW=${PILLOW_WHEEL:-}
if [ -z "$PILLOW" ]; then
  "$PY" -m pip download -q pillow==13.0.0 --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --no-deps -d "$B" >&2
else
  cp "$PILLOW" "$B/"
fi

# Files moved aside (scripts/dev/fixtures_aside.sh) do not travel: counted as absent.
tracked=$(git -C "$CHECKOUT" ls-files -z | (cd "$CHECKOUT" && xargs -0 stat -c %s 2>/dev/null || true) \
          | awk '{s += $1} END {print s}')
size() { du -sb "$1" | cut -f1; }
sa=$(size "$A")
sb=$(size "$B")
echo
echo "tracked files of $CHECKOUT: $tracked bytes"
ls -l "$A" "$B"
echo ".exl3v3-a: $sa bytes; with the tracked files $((tracked + sa)) of $LIMIT"
echo ".exl3v3-b: $sb bytes; with the tracked files $((tracked + sb)) of $LIMIT"
for s in $sa $sb; do
  if [ $((tracked + s)) -ge $LIMIT ]; then
    echo "exllamav3_stage: a call would carry more than $LIMIT bytes" >&2
    exit 1
  fi
done
cat <<MSG

Device calls, back to back (the second within 30 s of the first, on the same warm machine):

  call 1: carry [".exl3v3-a"]
    bash scripts/gpu/exllamav3_install.sh

  call 2: carry [".exl3v3-b"]
    bash scripts/gpu/exllamav3_run.sh

  (call 2 takes an optional comma-separated list of fixtures, to run part of the sweep:
   python3 scripts/conformance/exllamav3_fixtures.py sweep prints it. Running it again, with no
   argument, within 30 s on the same machine goes on with the fixtures not yet ok.)
Results: \$OUT/exllamav3_results.tar.xz (references, logs, configs), \$OUT/exllamav3_models_N.tar.xz
(the converted directories), \$OUT/status.json, \$OUT/run.log. Unpack the tars into one folder;
then: python3 scripts/conformance/exllamav3_fixtures.py commit --results FOLDER/results \\
        --out tests/fixtures/exllamav3
MSG
