# Sourced by the device-call scripts that run several steps inside one call's time
# (scripts/gpu/seed_model_checks.sh, speculative_checks.sh): LIMIT seconds from when it is
# sourced (set LIMIT first; default 300).
#   el           seconds since then
#   left         seconds of LIMIT left
#   upto N       a step's timeout: N, or what is left if less
LIMIT=${LIMIT:-300}
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( LIMIT - $(el) )); }
upto() { local l; l=$(left); echo $(( l > $1 ? $1 : l )); }
