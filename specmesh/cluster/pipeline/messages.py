"""The pipeline's messages: the Redis keys, the wire form of jobs, results, progress notes and closes
(their schema is protos/specmesh/v1/verifier.proto), and their signing.

Signing: Redis carries every job and result between routers and verifiers, so whoever can write to it
could post a result a router would stream to its client, or a job whose answer a verifier would cache for
someone else's request. With a queue key (``SPECMESH_QUEUE_KEY``, or ``--queue-key-file``), every entry
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

from specmesh.cluster.wire import features_to_pb, sampling_from_pb, sampling_to_pb, tree_from_pb, tree_to_pb
from specmesh.errors import InvalidArgument
from specmesh.runtime.calibration import PassCurve, PassSample
from specmesh.runtime.features import MAX_PROMPT_FEATURES
from specmesh.runtime.tree_verifier import VerifyJob, VerifyResult
from specmesh.v1 import common_pb2, verifier_pb2

GROUP = "verifiers"  # the verifiers' consumer group on every jobs stream


@dataclass(frozen=True)
class QueueKeys:
    pool: str = "default"
    prefix: str = "specmesh"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:{self.pool}:jobs"

    def own_jobs(self, verifier_id: str) -> str:
        return f"{self.prefix}:{self.pool}:jobs:{verifier_id}"

    def alive(self, verifier_id: str) -> str:
        return f"{self.prefix}:{self.pool}:alive:{verifier_id}"

    @property
    def members(self) -> str:
        return f"{self.prefix}:{self.pool}:verifiers"

    def results(self, router_id: str) -> str:
        return f"{self.prefix}:results:{router_id}"

    # the engine-core path (a verifier runs the step loop)
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
# what a tag vouches for: a result is never a valid job, nor a progress note a result
JOB, CLOSE, RESULT, PROGRESS = b"job", b"close", b"result", b"progress"
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


# ---- jobs, results and heartbeats ----


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


def encode_job(job: VerifyJob, reply_to: str, deadline_unix_ms: int) -> bytes:
    message = verifier_pb2.VerifyJob(
        request_id=job.request_id, step=job.step, position=job.position, root=job.root,
        tree=tree_to_pb(job.tree), sampling=sampling_to_pb(job.params), reply_to=reply_to,
        deadline_unix_ms=deadline_unix_ms, feature_layers=job.feature_layers,
        max_prompt_features=job.max_prompt_features if job.feature_layers else 0,
    )
    if job.history is not None:
        message.history.CopyFrom(common_pb2.TokenIds(ids=job.history))
    return message.SerializeToString()


@dataclass(frozen=True)
class QueuedJob:
    job: VerifyJob
    reply_to: str
    deadline_unix_ms: int


def decode_job(data: bytes) -> QueuedJob:
    message = verifier_pb2.VerifyJob.FromString(data)
    history = tuple(message.history.ids) if message.HasField("history") else None
    job = VerifyJob(
        message.request_id, message.step, message.position, message.root, tree_from_pb(message.tree),
        sampling_from_pb(message.sampling), history, tuple(message.feature_layers),
        message.max_prompt_features or MAX_PROMPT_FEATURES,
    )
    return QueuedJob(job, message.reply_to, message.deadline_unix_ms)


def encode_result(result: VerifyResult, verifier_id: str, **timings) -> bytes:
    status = (verifier_pb2.VerifyResult.EXHAUSTED if result.refused else
              verifier_pb2.VerifyResult.FAILED if result.failed else
              verifier_pb2.VerifyResult.RESYNC if result.resync else verifier_pb2.VerifyResult.OK)
    message = verifier_pb2.VerifyResult(
        request_id=result.request_id, step=result.step, status=status, verifier_id=verifier_id,
        message=result.refused or result.failed,
        prefilled_tokens=result.prefilled_tokens, pass_ms=result.pass_ms, batch_rows=result.batch_rows,
        batch_trees=result.batch_trees, **timings,
    )
    if result.verdict is not None:
        message.accepted_nodes.extend(result.verdict.accepted_nodes)
        message.tokens.extend(result.verdict.tokens)
    if result.features is not None:
        message.features.CopyFrom(features_to_pb(result.features))
    return message.SerializeToString()


def encode_progress(job: VerifyJob, verifier_id: str) -> bytes:
    """A prefill under way: the job is alive (a VerifyResult with no status, never taken for a result)."""
    return verifier_pb2.VerifyResult(request_id=job.request_id, step=job.step, verifier_id=verifier_id).SerializeToString()


def encode_error(request_id: str, step: int, verifier_id: str, text: str) -> bytes:
    return verifier_pb2.VerifyResult(
        request_id=request_id, step=step, status=verifier_pb2.VerifyResult.ERROR, verifier_id=verifier_id, message=text
    ).SerializeToString()
