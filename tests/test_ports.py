import socket

import pytest

from specmesh.cluster import ports


def test_free_port_is_bindable_and_outside_the_range_outgoing_connections_use():
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing holds it
    below = ports._below_ephemeral()
    if below is not None:  # Linux: an outgoing connection can never take it before the service binds
        assert port in below


def test_free_port_skips_a_port_in_use(monkeypatch):
    if ports._below_ephemeral() is None:
        pytest.skip("the kernel's ephemeral range is unknown here")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        free = ports.free_port()
        monkeypatch.setattr(ports.random, "sample", lambda population, k: [busy, free])
        assert ports.free_port() == free
