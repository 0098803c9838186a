"""Generated protobuf/gRPC stubs for the fleet collector (regenerate with scripts/gen_protos.sh)."""
