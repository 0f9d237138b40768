"""Loopback ports for the services a launcher or a test starts."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below it sit the well-known services' ports


def _below_ephemeral() -> range | None:
    """Ports the kernel never hands to an outgoing connection (None: unknown on this system)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(LOWEST, low) if low - LOWEST >= 1000 else None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nothing listens on, for a process started next to bind.

    Picked below the kernel's ephemeral range where it is known: a port the kernel chose for ``bind(0)``
    can be taken, between the check and the service's own bind, by any outgoing connection (the service's
    own to Redis included); one below the range can only be taken by another listener.
    """
    ports = _below_ephemeral()
    if ports is not None:
        for port in random.sample(ports, 50):
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
