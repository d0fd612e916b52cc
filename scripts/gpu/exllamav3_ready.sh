# Sourced by the device scripts that run exllamav3 (exllamav3_bench.sh, exllamav3_reverse.sh,
# exllamav3_mtp.sh); needs OUT.
#   exllamav3_ready          installs exllamav3 and the wheels it needs into $EXL3V3_SITE (default
#                            /tmp/site; scripts/gpu/exllamav3_install.sh, exllamav3_wheels.sh) unless a
#                            machine an earlier call left warm has them, and puts it on PYTHONPATH;
#                            non-zero (the install log's tail printed) when the install fails
#   fixtures_with_reference GLOB
#                            NAMES: the tests/fixtures/engine/GLOB directories whose
#                            reference.safetensors came along (comma-separated), SKIPPED: the others
#                            (a call may carry a directory without its files)
exllamav3_ready() {
  local site=${EXL3V3_SITE:-/tmp/site}
  if ! { [ -d "$site/exllamav3" ] && [ -d "$site/pydantic" ]; }; then
    { bash scripts/gpu/exllamav3_install.sh > "$OUT/install.log" 2>&1 &&
      bash scripts/gpu/exllamav3_wheels.sh > "$OUT/wheels.log" 2>&1; } ||
      { echo "exllamav3 install failed"; tail -5 "$OUT/install.log"; return 2; }
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
}

fixtures_with_reference() {
  NAMES= SKIPPED=
  local d
  for d in tests/fixtures/engine/$1; do
    [ -d "$d" ] || continue
    if [ -f "$d/reference.safetensors" ]; then NAMES=${NAMES:+$NAMES,}${d##*/}; else SKIPPED="$SKIPPED ${d##*/}"; fi
  done
}
