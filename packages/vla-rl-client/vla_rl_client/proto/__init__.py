"""Generated protobuf/gRPC stubs of the policy service and the fleet collector (regenerate with scripts/gen_protos.sh)."""
