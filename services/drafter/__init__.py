"""The drafter service (see README.md)."""
