#!/usr/bin/env bash
# The README's main job in its short mode: the whole stack on loopback, verified answers, and no
# process left behind afterwards; then again with --keep-running: the stack left up answers at the
# printed `openai:` address until Ctrl-C (SIGINT) takes it down.
# Each run has a process group of its own (started with job control, set -m, as in a terminal),
# which every process it starts joins; "left behind" is a process still in that group after the
# run, so servers of other runs on the machine (another check, a test) do not count.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${1:-build}
out=$(mktemp "${TMPDIR:-/tmp}/exl3-demo-check.XXXXXX")
demo=""
cleanup() {
  local status=$?
  # An interrupted check takes its demo's process group down with it.
  [ -z "$demo" ] || kill -INT -- "-$demo" 2>/dev/null || true
  rm -f "$out"
  exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# in_demo_group PATTERN: the processes of the demo's group whose command line matches PATTERN.
in_demo_group() { pgrep -a -g "$demo" -f "$1" || true; }

# left_behind WHAT: fails, listing them, if processes of the demo's group outlived the demo. A
# zombie is not counted: it has ended and holds nothing; an orphaned one waits for PID 1 to reap
# it, which some machines' init does only seconds later.
left_behind() {
  local left
  sleep 1
  left=$(pgrep -a -g "$demo" -r R,S,D,T,t,I || true)
  if [ -n "$left" ]; then
    echo "$1 left processes running (process group $demo):" >&2
    echo "$left" >&2
    exit 1
  fi
}

set -m
./scripts/demo.sh --short --no-deps --no-build --build-dir "$BUILD_DIR" >"$out" 2>&1 &
demo=$!
set +m
tail -n +1 -f --pid="$demo" "$out" &
shown=$!
# While it runs, the group holds its servers: the check after it looks at the right group.
seen=""
while kill -0 "$demo" 2>/dev/null; do
  [ -n "$seen" ] || seen=$(in_demo_group 'exl3-router')
  sleep 1
done
status=0
wait "$demo" || status=$?
wait "$shown" || true
[ "$status" = 0 ] || { echo "demo exited $status" >&2; exit "$status"; }
if [ -z "$seen" ]; then
  echo "no exl3-router of the demo was seen in its process group $demo" >&2
  exit 1
fi
# The run ends with the generation summary (README): every request answered, every reference
# matched; and the load generator's summary line is there too.
last=$(grep -v '^[[:space:]]*$' "$out" | tail -1)
if ! [[ "$last" =~ ^generate:\ requests=([0-9]+)\ ok=([0-9]+)\ failed=0\ reference_match=([0-9]+)/([0-9]+)\ ttft_p50_ms=[0-9.]+\ itl_p50_ms=[0-9.]+\ tok_s=[0-9.]+$ ]] ||
   [ "${BASH_REMATCH[1]}" != "${BASH_REMATCH[2]}" ] || [ "${BASH_REMATCH[3]}" != "${BASH_REMATCH[4]}" ] ||
   [ "${BASH_REMATCH[4]}" -eq 0 ]; then
  echo "demo's last line is not a passing generate: summary: $last" >&2
  exit 1
fi
grep -q '^requests=' "$out" || { echo "demo printed no exl3-loadgen summary line" >&2; exit 1; }
left_behind "demo"
demo=""

# --keep-running: after the same run the stack stays up and names the front end's address; a chat
# completion through it answers, and Ctrl-C takes it all down. Started with job control (set -m)
# the demo has a process group of its own, as in a terminal, and gets SIGINT as Ctrl-C sends it:
# to the whole group (its services, started in the background, ignore it; its exit trap stops them).
set -m
./scripts/demo.sh --short --no-deps --no-build --build-dir "$BUILD_DIR" --keep-running \
  --requests 24 >"$out" 2>&1 &
demo=$!
set +m
url=""
for _ in $(seq 1 900); do
  url=$(sed -n 's|^openai: \(http://[0-9.:]*/v1\)$|\1|p' "$out" | head -1)
  [ -n "$url" ] && break
  kill -0 "$demo" 2>/dev/null || break
  sleep 1
done
answer=""
if [ -n "$url" ]; then
  answer=$(curl -fsS --max-time 60 "$url/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}' || true)
fi
kill -INT -- "-$demo" 2>/dev/null || true
status=0
wait "$demo" || status=$?
if [ -z "$url" ]; then
  echo "demo --keep-running printed no 'openai: http://HOST:PORT/v1' line:" >&2
  tail -30 "$out" >&2
  exit 1
fi
if ! printf '%s' "$answer" | python3 -c 'import json, sys; a = json.load(sys.stdin)
assert a["object"] == "chat.completion" and a["choices"][0]["message"]["role"] == "assistant"'; then
  echo "no chat completion from the stack left running at $url: $answer" >&2
  exit 1
fi
[ "$status" = 130 ] || { echo "demo --keep-running exited $status on SIGINT (expected 130)" >&2; exit 1; }
left_behind "demo --keep-running, after SIGINT,"
demo=""
echo "demo check passed"
