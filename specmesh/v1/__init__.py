"""Generated protobuf and gRPC code for the ``specmesh.v1`` wire schema (``make proto``; do not edit)."""
