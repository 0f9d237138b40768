"""The cluster's parts: the router's gateway, the Redis pipeline queue and batch scheduling, remote adapters,
discovery, serving, the wire format, metrics, and the one-machine launcher."""
