"""The pipeline queue: requests admitted to the verifiers, and their answers, over Redis Streams.

Keys, for a verifier pool ``P`` (prefix ``specmesh``):
- ``specmesh:P:admissions`` — requests admitted by the routers; consumer group ``verifiers``: one verifier
  takes each, and holds it pending until the request ends.
- ``specmesh:P:aborts`` — requests whose client left; read by every verifier.
- ``specmesh:outputs:<router>`` — a router's outputs stream: one message a verifier step, every delta of the
  router's requests in it.
- ``specmesh:P:log:<verifier>`` — a verifier's commit log, from which another adopts a dead one's requests.
- ``specmesh:P:alive:<verifier>`` — a heartbeat key that expires when the verifier stops beating; its value
  is the verifier's pass curve measured at start-up, which calibrates the routers' cost models.
- ``specmesh:P:verifiers`` — the set of verifiers that ever registered (to find dead ones' admissions).
- ``specmesh:P:routing`` — the routers' routing snapshot (``policy_sync.py``).

Nothing is lost: an admission stays pending under the verifier that took it until its request ends; a
verifier whose heartbeat stopped has its admissions claimed by another, which goes on from its commit log
(``engine_worker.py``); routers drop deltas they already have. Every stream is bounded: outputs streams are
trimmed to what was read, commit logs to what the held requests need, admissions acknowledged and deleted
at their request's end, and a router refuses new requests when the admissions backlog is too long.
"""
