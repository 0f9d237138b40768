"""The router service (see README.md)."""
