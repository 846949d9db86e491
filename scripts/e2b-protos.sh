#!/usr/bin/env bash
# Regenerate kernel_env/server/e2b/proto/ from E2B's envd protocol definitions kept there
# (process/process.proto, filesystem/filesystem.proto: E2B's spec/envd, Apache-2.0: LICENSE beside them), with the
# generators E2B's Python SDK uses: protoc-gen-py (protobuf-py messages) and
# protoc-gen-connectrpc (the Connect services), at the versions of the connectrpc and
# protobuf-py that kernel_env's e2b extra pins. protoc comes from grpcio-tools.
#
#   scripts/e2b-protos.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$ROOT/kernel_env/server/e2b/proto
TOOLS=$(mktemp -d)
trap 'rm -rf "$TOOLS"' EXIT

"${PYTHON:-python3}" -m venv "$TOOLS/venv"
"$TOOLS/venv/bin/pip" install -q grpcio-tools==1.85.1 protoc-gen-connectrpc==0.12.1 \
    protoc-gen-py==0.6.0
WKT=$("$TOOLS/venv/bin/python" -c \
    "import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), '_proto'))")
mkdir "$TOOLS/out"
cd "$OUT"
"$TOOLS/venv/bin/python" -m grpc_tools.protoc -I . -I "$WKT" \
    --plugin=protoc-gen-protobufpy="$TOOLS/venv/bin/protoc-gen-py" --protobufpy_out="$TOOLS/out" \
    --plugin=protoc-gen-connectrpc="$TOOLS/venv/bin/protoc-gen-connectrpc" \
    --connectrpc_out="$TOOLS/out" process/process.proto filesystem/filesystem.proto
for service in process filesystem; do
    cp "$TOOLS/out/$service/${service}_pb.py" "$TOOLS/out/$service/${service}_connect.py" "$service/"
done
echo "generated into $OUT"
