#!/usr/bin/env bash
# Generates the Python protobuf + gRPC stubs of proto/exl3serve/v1/exl3serve.proto into OUT_DIR
# (importable as `exl3serve.v1.exl3serve_pb2` / `exl3serve_pb2_grpc`), with Debian's protoc and
# grpc_python_plugin (packages protobuf-compiler and protobuf-compiler-grpc).
# Usage: clients/python/generate_stubs.sh OUT_DIR
# PROTOC and GRPC_PYTHON_PLUGIN name the tools (the build passes the ones CMake found); by default
# they are looked up on PATH.
set -euo pipefail
out="${1:?usage: generate_stubs.sh OUT_DIR}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
protoc="${PROTOC:-protoc}"
plugin="${GRPC_PYTHON_PLUGIN:-$(command -v grpc_python_plugin || true)}"
if [ -z "$plugin" ]; then
  echo "generate_stubs.sh: grpc_python_plugin not found (apt-get install protobuf-compiler-grpc)" >&2
  exit 1
fi
mkdir -p "$out"
"$protoc" --proto_path="$root/proto" --python_out="$out" --grpc_out="$out" \
  --plugin=protoc-gen-grpc="$plugin" "$root/proto/exl3serve/v1/exl3serve.proto"
touch "$out/exl3serve/__init__.py" "$out/exl3serve/v1/__init__.py"
