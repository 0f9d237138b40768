"""The pipeline's messages: the Redis keys, the heartbeat's pass curve, and the signing of every entry
(the messages' schema is protos/specmesh/v1/verifier.proto: admissions, step outputs, aborts, routing).

Signing: Redis carries every admission and step output between routers and verifiers, so whoever can write
to it could post outputs a router would stream to its client, or an admission a verifier would run for
someone else's router. With a queue key (``SPECMESH_QUEUE_KEY``, or ``--queue-key-file``), every entry
carries an HMAC-SHA256 tag over its kind and bytes; an entry with a missing or wrong tag is dropped and
counted, never acted on. Without a key (a cluster on one machine that trusts its Redis) entries are
neither tagged nor checked; ``specmesh up`` makes a fresh key for each cluster it starts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from specmesh.errors import InvalidArgument
from specmesh.runtime.calibration import PassCurve, PassSample

GROUP = "verifiers"  # the verifiers' consumer group on the admissions stream


@dataclass(frozen=True)
class QueueKeys:
    pool: str = "default"
    prefix: str = "specmesh"

    def alive(self, verifier_id: str) -> str:
        return f"{self.prefix}:{self.pool}:alive:{verifier_id}"

    @property
    def members(self) -> str:
        return f"{self.prefix}:{self.pool}:verifiers"

    @property
    def admissions(self) -> str:
        return f"{self.prefix}:{self.pool}:admissions"

    @property
    def aborts(self) -> str:
        return f"{self.prefix}:{self.pool}:aborts"

    def outputs(self, router_id: str) -> str:
        return f"{self.prefix}:outputs:{router_id}"

    def commit_log(self, verifier_id: str) -> str:
        return f"{self.prefix}:{self.pool}:log:{verifier_id}"

    @property
    def routing(self) -> str:
        """The routing policy's snapshot (a hash: version, snapshot, tag): routers write it, verifiers read it
        (``policy_sync.py``)."""
        return f"{self.prefix}:{self.pool}:routing"


# ---- signing ----

ENV_KEY = "SPECMESH_QUEUE_KEY"
MIN_KEY_CHARS = 16
# what a tag vouches for: an admission is never valid outputs, nor an abort an admission
ADMISSION, ABORT, OUTPUTS = b"admission", b"abort", b"outputs"
ROUTING = b"routing"  # a routing snapshot (policy_sync.py)
CONTROL = b"control"  # the bearer token of the verifiers' control API (Info, Drain) without mutual TLS


def new_key() -> str:
    return secrets.token_urlsafe(32)


class QueueSigner:
    def __init__(self, key: str | None = None) -> None:
        if key is not None and len(key.strip()) < MIN_KEY_CHARS:
            raise InvalidArgument("queue_key", f"must be at least {MIN_KEY_CHARS} characters")
        self._key = key.strip().encode() if key else None

    @classmethod
    def from_environment(cls, file: str | Path | None = None) -> QueueSigner:
        """The key from ``file`` if given, else ``$SPECMESH_QUEUE_KEY``; neither: no signing."""
        if file:
            path = Path(file)
            if not path.is_file():
                raise InvalidArgument("queue_key_file", f"{path} is not a file")
            return cls(path.read_text())
        return cls(os.environ.get(ENV_KEY) or None)

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def tag(self, kind: bytes, payload: bytes) -> bytes:
        """The entry's tag (empty without a key)."""
        if self._key is None:
            return b""
        return hmac.new(self._key, kind + b"\x00" + payload, hashlib.sha256).digest()

    def control_token(self) -> str | None:
        """What a caller of a verifier's control API presents (``authorization: Bearer <token>``) where
        there is no mutual TLS: derived from the key, so holding it lets one drain a verifier, not forge
        queue entries. None without a key."""
        return self.tag(CONTROL, b"").hex() if self._key is not None else None

    def valid(self, kind: bytes, payload: bytes, tag: bytes | None) -> bool:
        if self._key is None:
            return True
        return tag is not None and hmac.compare_digest(self.tag(kind, payload), tag)


# ---- heartbeats ----


MAX_CURVE_SAMPLES = 64


def encode_pass_curve(curve: PassCurve) -> bytes:
    passes = [[s.requests, s.trees, s.rows, s.ms] for s in curve.samples[:MAX_CURVE_SAMPLES]]
    return json.dumps({"device": curve.device, "passes": passes}).encode()


def decode_pass_curve(data: bytes | None) -> PassCurve | None:
    """A heartbeat's pass curve; None for a bare heartbeat or anything that is not a sound curve (it only
    steers speed, but a value in Redis is not trusted to be one)."""
    if not data or data == b"1":
        return None
    try:
        message = json.loads(data)
        device = str(message["device"])[:16]
        samples = tuple(PassSample(int(r), int(t), int(n), float(ms))
                        for r, t, n, ms in message["passes"][:MAX_CURVE_SAMPLES])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    sound = samples and all(1 <= s.requests <= s.rows <= 1 << 20 and 0 <= s.trees <= s.requests and 0 < s.ms < 1e6
                            and math.isfinite(s.ms) for s in samples)
    return PassCurve(device, samples) if sound else None
