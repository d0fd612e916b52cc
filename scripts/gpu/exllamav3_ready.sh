# Sourced by the device scripts that run exllamav3 (exllamav3_bench.sh, exllamav3_reverse.sh,
# exllamav3_mtp.sh); needs OUT.
#   exllamav3_ready          installs exllamav3 and the wheels it needs into $EXL3V3_SITE (default
#                            /tmp/site; scripts/gpu/exllamav3_install.sh, exllamav3_wheels.sh) unless a
#                            machine an earlier call left warm has them, and puts it on PYTHONPATH;
#                            non-zero (the install log's tail printed) when the install fails
#   fixtures_to_check NAMES_ARG GLOB
#                            NAMES: NAMES_ARG where given, else the tests/fixtures/engine/GLOB
#                            directories whose reference.safetensors came along (comma-separated);
#                            SKIPPED: the others (a call may carry a directory without its files);
#                            non-zero when no fixture is left
exllamav3_ready() {
  local site=${EXL3V3_SITE:-/tmp/site}
  if ! { [ -d "$site/exllamav3" ] && [ -d "$site/pydantic" ]; }; then
    { bash scripts/gpu/exllamav3_install.sh > "$OUT/install.log" 2>&1 &&
      bash scripts/gpu/exllamav3_wheels.sh > "$OUT/wheels.log" 2>&1; } ||
      { echo "exllamav3 install failed"; tail -5 "$OUT/install.log"; return 2; }
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
}

fixtures_to_check() {
  NAMES=$1 SKIPPED=
  [ -n "$NAMES" ] && return 0
  local d
  for d in tests/fixtures/engine/$2; do
    [ -d "$d" ] || continue
    if [ -f "$d/reference.safetensors" ]; then NAMES=${NAMES:+$NAMES,}${d##*/}; else SKIPPED="$SKIPPED ${d##*/}"; fi
  done
  [ -n "$NAMES" ] || { echo "no tests/fixtures/engine/$2 fixture with reference.safetensors"; return 2; }
}
