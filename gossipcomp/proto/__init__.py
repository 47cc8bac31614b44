"""Generated protocol buffer and gRPC stubs; regenerate with scripts/generate_protos.py."""
