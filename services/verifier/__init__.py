"""The verifier service (see README.md)."""
