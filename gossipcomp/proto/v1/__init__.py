"""Generated gRPC stubs for gossipcomp.v1 (scripts/generate_protos.py)."""
