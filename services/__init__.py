"""specmesh's gRPC services: thin servicers over the core, one process each."""
