"""API keys for the router's client APIs (gRPC and HTTP): who may call, and how much each may ask.

Keys come from ``SPECMESH_API_KEYS`` (comma-separated) and an optional file (``--api-keys-file``: one
key a line, ``#`` comments; a line may hold ``sha256:<hex>`` instead of the key, and a name after
whitespace). Only SHA-256 digests are kept in memory. The file is read again when it changes, so keys
rotate without a restart. Each key has a concurrency limit and a rate limit (a token bucket holding a
minute's requests); past either, a call is refused with ResourceExhausted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from specmesh.errors import InvalidArgument, ResourceExhausted, Unauthenticated

log = logging.getLogger("specmesh.cluster.auth")

ENV_KEYS = "SPECMESH_API_KEYS"
RELOAD_EVERY_S = 1.0  # how stale a rotated key file may be
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: the key's name (never the key)."""

    name: str


def parse_keys(lines: Iterable[str], where: str) -> dict[str, str]:
    """Key lines -> {sha256 digest: name}. Refuses short keys and malformed digests."""
    keys: dict[str, str] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):  # a comment is a line of its own: a key may hold "#"
            continue
        secret, *rest = line.split()
        if secret.startswith("sha256:"):
            hashed = secret.removeprefix("sha256:").lower()
            if len(hashed) != 64 or any(c not in "0123456789abcdef" for c in hashed):
                raise InvalidArgument("api_keys", f"{where} line {number}: sha256: must be followed by 64 hex digits")
        elif len(secret) < 16:
            raise InvalidArgument("api_keys", f"{where} line {number}: a key must be at least 16 characters")
        else:
            hashed = digest(secret)
        keys[hashed] = rest[0] if rest else f"key-{hashed[:8]}"
    return keys


class ApiKeys:
    """The keys the router accepts; ``authenticate`` takes an ``Authorization`` value ("Bearer <key>")."""

    def __init__(self, env_keys: str = "", file: str | Path | None = None) -> None:
        self._env = parse_keys(env_keys.replace(",", "\n").splitlines(), ENV_KEYS)
        self.file = Path(file) if file else None
        self._file_keys: dict[str, str] = {}
        self._stamp: tuple[float, int] | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if self.file is not None:
            if not self.file.is_file():
                raise InvalidArgument("api_keys_file", f"{self.file} is not a file")
            self._reload()

    @classmethod
    def from_environment(cls, file: str | Path | None = None) -> ApiKeys:
        return cls(os.environ.get(ENV_KEYS, ""), file)

    @property
    def enabled(self) -> bool:
        return bool(self._env) or self.file is not None

    def __len__(self) -> int:
        return len(self._env) + len(self._file_keys)

    def authenticate(self, authorization: str | None) -> Caller:
        if not authorization:
            raise Unauthenticated("no API key: send 'authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("the authorization must be 'Bearer <key>'")
        self._maybe_reload()
        hashed = digest(key.strip())
        name = self._env.get(hashed) or self._file_keys.get(hashed)
        if name is None:
            raise Unauthenticated("the API key is not valid")
        return Caller(name)

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if self.file is None or now - self._checked < RELOAD_EVERY_S:
            return
        self._checked = now
        self._reload()

    def _reload(self) -> None:
        """Read the file again if it changed; a file that vanished or became invalid keeps the last keys."""
        try:
            stat = self.file.stat()
            stamp = (stat.st_mtime, stat.st_size)
            if stamp == self._stamp:
                return
            keys = parse_keys(self.file.read_text().splitlines(), str(self.file))
        except (OSError, InvalidArgument) as exc:
            if self._stamp is None:
                raise
            log.error("API keys not reloaded, the last good ones stay in force: %s", exc)
            return
        with self._lock:
            self._file_keys, self._stamp = keys, stamp


class KeyLimits:
    """Per caller: at most ``max_concurrent`` calls at once and ``per_minute`` calls a minute (0: no limit)."""

    def __init__(self, max_concurrent: int = 0, per_minute: int = 0) -> None:
        if max_concurrent < 0 or per_minute < 0:
            raise InvalidArgument("key_limits", "limits must be >= 0 (0: none)")
        self.max_concurrent, self.per_minute = max_concurrent, per_minute
        self._active: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # name -> (tokens, when)

    def admit(self, caller: Caller) -> Permit:
        """A permit for one call, to release when it ends; raises ResourceExhausted past a limit."""
        active = self._active.get(caller.name, 0)
        if self.max_concurrent and active >= self.max_concurrent:  # first: a refused call spends no rate
            raise ResourceExhausted(f"API key {caller.name!r} has {active} calls in flight, its limit; retry later")
        if self.per_minute:
            tokens, when = self._buckets.get(caller.name, (float(self.per_minute), time.monotonic()))
            now = time.monotonic()
            tokens = min(float(self.per_minute), tokens + (now - when) * self.per_minute / 60.0)
            if tokens < 1.0:
                self._buckets[caller.name] = (tokens, now)
                wait = (1.0 - tokens) * 60.0 / self.per_minute
                raise ResourceExhausted(f"API key {caller.name!r} is limited to {self.per_minute} calls a minute; "
                                        f"retry in {wait:.1f} s")
            self._buckets[caller.name] = (tokens - 1.0, now)
        self._active[caller.name] = active + 1
        return Permit(self, caller.name)

    def active(self, name: str) -> int:
        return self._active.get(name, 0)

    def _release(self, name: str) -> None:
        left = self._active.get(name, 0) - 1
        if left > 0:
            self._active[name] = left
        else:
            self._active.pop(name, None)


class Permit:
    def __init__(self, limits: KeyLimits, name: str) -> None:
        self._limits, self._name, self._held = limits, name, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limits._release(self._name)

    def __enter__(self) -> Permit:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class Access:
    """The router's access policy: its keys (none: anyone on loopback) and each key's limits."""

    keys: ApiKeys
    limits: KeyLimits

    def admit(self, authorization: str | None) -> Permit | None:
        """Authenticate and admit one call (None when no keys are configured: nothing to hold)."""
        if not self.keys.enabled:
            return None
        return self.limits.admit(self.keys.authenticate(authorization))


def is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0] if ":" in address else address
    return host in LOOPBACK_HOSTS


def check_exposure(access: Access, addresses: Iterable[str]) -> None:
    """Without keys the router may listen on loopback only: anyone who can reach it could use it."""
    if access.keys.enabled:
        return
    exposed = [a for a in addresses if a and not is_loopback(a)]
    if exposed:
        raise InvalidArgument("api_keys", f"no API keys are configured, so the router listens on loopback only; "
                              f"{', '.join(exposed)} is not (set {ENV_KEYS} or --api-keys-file)")
