"""Redis users per role: each may run only the commands its side of the pipeline needs, on its own keys
(Redis 7 ACL selectors: a command allowed on one key pattern only).

- router: admits requests (and looks whether one is still waiting), posts aborts, reads and trims its
  outputs stream, reads the verifiers' liveness and the drafters' registry, and reads and writes the routing
  snapshot (``pipeline/policy_sync.py``, by a compare-and-set script). It cannot post outputs or take an
  admission.
- verifier: takes admissions (consumer group; a dead one's it claims), reads aborts, posts outputs, keeps
  its commit log (and reads and deletes a dead one's), beats its heartbeat and joins the member set, and
  reads the routing snapshot. It cannot admit a request, read outputs or write the routing snapshot.
- drafter: announces itself in the registry (``--announce``), nothing else.

``specmesh redis-acl`` prints these as ACL file lines (``users.acl``) or ``ACL SETUSER`` commands; the
services then connect with ``redis://USER:PASSWORD@host`` (``rediss://`` over TLS).
"""

from __future__ import annotations

from specmesh.errors import InvalidArgument

ROLES = ("router", "verifier", "drafter")
CONNECTION = "+ping +client|setname +hello +select"  # what any client may send on connecting


def role_rules(role: str, prefix: str = "specmesh") -> list[str]:
    """The role's ACL rules after ``resetkeys resetchannels -@all`` (each parenthesised one a selector)."""
    alive = f"{prefix}:*:alive:*"
    members, drafters = f"{prefix}:*:verifiers", f"{prefix}:drafters:*"
    admissions, aborts, outputs = f"{prefix}:*:admissions", f"{prefix}:*:aborts", f"{prefix}:outputs:*"
    commit_logs, routing = f"{prefix}:*:log:*", f"{prefix}:*:routing"
    rules = {
        "router": [
            f"(+smembers %R~{members})",
            f"(+get %R~{alive})",
            f"(+scan %R~{drafters})",
            f"(+xadd +xlen +xrange +xinfo|groups %RW~{admissions})",
            f"(+xadd %W~{aborts})",
            f"(+xread +xtrim %RW~{outputs})",
            # the routing snapshot: read, and written by compare-and-set (policy_sync.PUBLISH, whose commands
            # are checked against these rules)
            f"(+hmget +hget +hset +evalsha +eval %RW~{routing})",
            "+script|load",
        ],
        "verifier": [
            f"(+set +del +exists %RW~{alive})",
            f"(+sadd +smembers %RW~{members})",
            f"(+xgroup|create +xreadgroup +xack +xdel +xpending +xclaim %RW~{admissions})",
            f"(+xadd +xrange +xtrim +del %RW~{commit_logs})",
            "+multi +exec",  # an adoption's snapshot and the dead verifier's log deletion go together
            # a step's outputs, its commit log entry and the finished requests' acks: one script, fenced by
            # the alive key (engine_worker.PUBLISH); the commands it runs are checked against the rules here
            f"(+evalsha +eval %RW~{alive} %RW~{commit_logs} %RW~{admissions} %RW~{outputs})",
            "+script|load",
            f"(+xread +xrevrange %R~{aborts})",
            f"(+xadd %W~{outputs})",
            f"(+hmget %R~{routing})",  # the routers' routing snapshot: read only
        ],
        "drafter": [f"(+set +del %W~{drafters})"],
    }
    if role not in rules:
        raise InvalidArgument("role", f"is {role!r}; one of {', '.join(ROLES)}")
    return rules[role]


def redis_user(role: str) -> str:
    """The user name a role connects as (the chart's and ``specmesh up``'s)."""
    return f"specmesh-{role}"


def acl_line(role: str, user: str, password: str, prefix: str = "specmesh") -> str:
    """One ``users.acl`` line: the user, on, its password, and nothing but its role's rules."""
    if not user or any(c.isspace() for c in user):
        raise InvalidArgument("user", "must be one word")
    if len(password) < 16 or any(c.isspace() for c in password):
        raise InvalidArgument("password", "must be at least 16 characters, without spaces")
    return " ".join(["user", user, "on", f">{password}", "resetkeys", "resetchannels", "-@all", CONNECTION,
                     *role_rules(role, prefix)])


def admin_line(password: str) -> str:
    """The default user with every right (operators, probes), for an ACL file (which replaces requirepass)."""
    if not password or any(c.isspace() for c in password):
        raise InvalidArgument("password", "the admin password must be one word")
    return f"user default on >{password} ~* &* +@all"
