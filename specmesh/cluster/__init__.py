"""The cluster's parts: the router's gateway, the Redis pipeline queue and the verifiers' engine loop, remote
adapters, discovery, serving, the wire format, metrics, and the one-machine launcher."""
