#!/usr/bin/env bash
# Regenerate generated/ from protos/ (pb2, pb2_grpc, .pyi): the one command for it.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default generated/; uses $PYTHON or .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-generated}
py=${PYTHON:-.venv/bin/python}
rm -rf "$out/xserv"
mkdir -p "$out"
"$py" -m grpc_tools.protoc -I protos --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" protos/xserv/v1/engine.proto
touch "$out/xserv/__init__.py" "$out/xserv/v1/__init__.py"
