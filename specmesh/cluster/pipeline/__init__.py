"""The pipeline queue: verification jobs and their results over Redis Streams.

Keys, for a verifier pool ``P`` (prefix ``specmesh``):
- ``specmesh:P:jobs`` — the pool's stream; consumer group ``verifiers``; requests without a verifier yet.
- ``specmesh:P:jobs:<verifier>`` — one verifier's own stream (affinity: its KV cache holds the request).
- ``specmesh:P:alive:<verifier>`` — a heartbeat key that expires when the verifier stops beating; its value
  is the verifier's pass curve measured at start-up, which calibrates the routers' cost models.
- ``specmesh:P:verifiers`` — the set of verifiers that ever registered (to find dead ones' streams).
- ``specmesh:results:<router>`` — a router's results stream.

Delivery is at least once. A verifier acknowledges (and deletes) an entry only after its result is
posted; entries held by a verifier whose heartbeat stopped are reclaimed by the others (its pending
pool entries claimed, its own stream adopted), and a restarted verifier serves what it held before. A
router whose job is no longer in its stream without an answer (Redis lost it) posts it again, and once
it is answered closes the request on the other verifiers (one may hold a session a lost copy opened);
a job still queued, or held by a live verifier however long its pass, is waited for; a prefill longer
than the job timeout is too, while its verifier reports progress on the results stream. Results are
idempotent: (request, step) names a job, and a router takes the first result of a step and ignores the
rest. Every stream is bounded: jobs are deleted once answered, result streams are trimmed to what was
read (and capped), and the router refuses new requests when the pool's backlog is too long.
"""
