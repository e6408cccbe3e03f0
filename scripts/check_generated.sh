#!/usr/bin/env bash
# Fail when generated/ is stale: regenerate into a temp folder and compare.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bash scripts/gen_protos.sh "$tmp"
if ! diff -r -x __pycache__ generated/xserv "$tmp/xserv"; then
  echo "generated/ is stale: run scripts/gen_protos.sh and commit the result" >&2
  exit 1
fi
echo "generated/ is up to date"
