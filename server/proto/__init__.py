"""Generated protobuf/gRPC stubs for the policy service (regenerate with scripts/gen_protos.sh)."""
