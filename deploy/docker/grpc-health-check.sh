#!/bin/bash
# grpc-health-check: asks a gRPC server's standard health service (grpc.health.v1.Health/Check)
# whether it is SERVING, with nothing but curl (HTTP/2). Exit 0 when SERVING, 1 otherwise.
# Used as the images' HEALTHCHECK and by compose; Kubernetes uses its native gRPC probe instead.
#
#   grpc-health-check [HOST:PORT] [SERVICE]     default 127.0.0.1:50061, overall health ("")
#
# TLS: set GRPC_HEALTH_CA (CA file; turns TLS on), and for mutual TLS GRPC_HEALTH_CERT and
# GRPC_HEALTH_KEY. GRPC_HEALTH_TIMEOUT (seconds, default 3) bounds the call.
set -euo pipefail

addr=${1:-127.0.0.1:50061}
service=${2:-}
timeout=${GRPC_HEALTH_TIMEOUT:-3}

len=$(printf '%s' "$service" | wc -c)
if [ "$len" -gt 127 ]; then
  echo "grpc-health-check: service name longer than 127 bytes" >&2
  exit 2
fi

# The request: a gRPC frame (1 byte uncompressed flag, 4 bytes big-endian length) holding a
# HealthCheckRequest, whose only field is `string service = 1` (tag 0x0a, then its length).
request() {
  if [ "$len" -eq 0 ]; then
    printf '\000\000\000\000\000'
  else
    printf '\000\000\000\000'"\\$(printf '%03o' $((len + 2)))"'\012'"\\$(printf '%03o' "$len")"
    printf '%s' "$service"
  fi
}

set -- --silent --show-error --max-time "$timeout" --request POST \
  --header 'content-type: application/grpc' --header 'te: trailers' --data-binary @-
if [ -n "${GRPC_HEALTH_CA:-}" ]; then
  set -- "$@" --http2 --cacert "$GRPC_HEALTH_CA"
  [ -n "${GRPC_HEALTH_CERT:-}" ] && set -- "$@" --cert "$GRPC_HEALTH_CERT" --key "$GRPC_HEALTH_KEY"
  url="https://$addr/grpc.health.v1.Health/Check"
else
  set -- "$@" --http2-prior-knowledge
  url="http://$addr/grpc.health.v1.Health/Check"
fi

# The answer: a frame holding a HealthCheckResponse, whose only field is `status = 1`:
# 00 00000002 08 01 is SERVING. An empty message means UNKNOWN; an error status (e.g. NOT_FOUND
# for an unknown service name) comes with no frame at all.
if ! body=$(request | curl "$@" "$url" | od -An -v -tx1 | tr -d ' \n'); then
  echo "grpc-health-check: $addr: no answer" >&2
  exit 1
fi
case "$body" in
  00000000020801) exit 0 ;;
  00000000020802) status=NOT_SERVING ;;
  00000000020803) status=SERVICE_UNKNOWN ;;
  0000000000 | 00000000020800) status=UNKNOWN ;;
  "") status="an error (unknown service \"$service\"?)" ;;
  *) status="an unexpected answer $body" ;;
esac
echo "grpc-health-check: $addr: $status" >&2
exit 1
