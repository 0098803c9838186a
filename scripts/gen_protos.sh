#!/usr/bin/env bash
# Regenerate the Python gRPC stubs from server/proto/*.proto and fleet/proto/*.proto (grpc_tools, no
# system protoc needed).
#
# Usage: scripts/gen_protos.sh [OUT_DIR [FLEET_OUT_DIR]]   (defaults: server/proto and fleet/proto, in place)
# PYTHON selects the interpreter (default: .venv/bin/python when present, else python3).
#
# protoc emits `import policy_service_pb2 as ...` in the *_pb2_grpc.py file, which only works when the
# folder itself is on sys.path; we rewrite it to a relative import so `server.proto` works as a package.
# tests/test_server_proto.py regenerates into a temporary folder and checks the committed files match.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
OUT="${1:-$ROOT/server/proto}"
mkdir -p "$OUT"
cd "$ROOT/server/proto"
for proto in *.proto; do
  "$PYTHON" -m grpc_tools.protoc -I . --python_out="$OUT" --grpc_python_out="$OUT" --pyi_out="$OUT" "$proto"
  stem="${proto%.proto}"
  sed -i -E "s/^import ${stem}_pb2 as /from . import ${stem}_pb2 as /" "$OUT/${stem}_pb2_grpc.py"
done

# fleet/proto imports policy_service.proto (for Tensor): compile with both folders on the include path
# and point the generated import at the server.proto package.
FLEET_OUT="${2:-$ROOT/fleet/proto}"
mkdir -p "$FLEET_OUT"
cd "$ROOT/fleet/proto"
for proto in *.proto; do
  "$PYTHON" -m grpc_tools.protoc -I . -I "$ROOT/server/proto" \
    --python_out="$FLEET_OUT" --grpc_python_out="$FLEET_OUT" --pyi_out="$FLEET_OUT" "$proto"
  stem="${proto%.proto}"
  sed -i -E "s/^import ${stem}_pb2 as /from . import ${stem}_pb2 as /" "$FLEET_OUT/${stem}_pb2_grpc.py"
  sed -i -E "s/^import policy_service_pb2 as /from server.proto import policy_service_pb2 as /" \
    "$FLEET_OUT/${stem}_pb2.py" "$FLEET_OUT/${stem}_pb2.pyi"
done
