#!/usr/bin/env bash
# Regenerate the Python gRPC stubs of packages/vla-rl-client/vla_rl_client/proto/*.proto (grpc_tools, no
# system protoc needed).
#
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: the proto folder itself, in place)
# PYTHON selects the interpreter (default: .venv/bin/python when present, else python3).
#
# protoc emits `import policy_service_pb2 as ...` (in the *_pb2_grpc.py files, and in collector_pb2.py,
# which imports policy_service.proto for Tensor); that only works with the folder itself on sys.path, so
# we rewrite them to relative imports and `vla_rl_client.proto` works as a package.
# tests/test_server_proto.py regenerates into a temporary folder and checks the committed files match.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
PROTO="$ROOT/packages/vla-rl-client/vla_rl_client/proto"
OUT="${1:-$PROTO}"
mkdir -p "$OUT"
cd "$PROTO"
stems=()
for proto in *.proto; do stems+=("${proto%.proto}"); done
for proto in *.proto; do
  "$PYTHON" -m grpc_tools.protoc -I . --python_out="$OUT" --grpc_python_out="$OUT" --pyi_out="$OUT" "$proto"
done
for stem in "${stems[@]}"; do
  for other in "${stems[@]}"; do
    sed -i -E "s/^import ${other}_pb2 as /from . import ${other}_pb2 as /" \
      "$OUT/${stem}_pb2.py" "$OUT/${stem}_pb2.pyi" "$OUT/${stem}_pb2_grpc.py"
  done
done
