#!/usr/bin/env bash
# Regenerates the committed Python modules for protos/fedsparse/v1/*.proto:
#   protos/fedsparse/v1/payload_pb2.py and payload_pb2.pyi
# with the protoc bundled in grpcio-tools (tests/test_protos.py fails if they are stale).
#
# Usage: scripts/gen_protos.sh            (from anywhere; uses .venv/bin/python)
#        PYTHON=python3 scripts/gen_protos.sh
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"

echo "protoc: $("$PYTHON" -m grpc_tools.protoc --version)"
"$PYTHON" -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
    protos/fedsparse/v1/payload.proto
echo "wrote protos/fedsparse/v1/payload_pb2.py protos/fedsparse/v1/payload_pb2.pyi"
