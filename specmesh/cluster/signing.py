"""Message authentication on the pipeline queue: HMAC-SHA256 under a key the routers and verifiers share.

Redis carries every job and result between routers and verifiers, so whoever can write to it could
post a result a router would stream to its client, or a job whose answer a verifier would cache for
someone else's request. With a queue key (``SPECMESH_QUEUE_KEY``, or ``--queue-key-file``), every
entry carries a tag over its kind and bytes; an entry with a missing or wrong tag is dropped and
counted, never acted on. Without a key (a cluster on one machine that trusts its Redis) entries are
neither tagged nor checked; ``specmesh up`` makes a fresh key for each cluster it starts.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from specmesh.errors import InvalidArgument

ENV_KEY = "SPECMESH_QUEUE_KEY"
MIN_KEY_CHARS = 16
# what a tag vouches for: a result is never a valid job, nor a progress note a result
JOB, CLOSE, RESULT, PROGRESS = b"job", b"close", b"result", b"progress"
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
