"""An optional baseline in a child process of its own: a crash in its native code (llama.cpp built for
another CPU dies of an illegal instruction) ends that child, and the bench records it and goes on.

The child is spawned (a fresh interpreter: nothing of the bench's threads or torch state is copied) and
ends with the bench, however the bench ends.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Any, Callable

from specmesh.cluster.lifetime import die_with
from specmesh.errors import SpecmeshError


class BaselineFailed(SpecmeshError):
    """The baseline's process ended (a signal, an exit) or its code raised: why, in words."""


class IsolatedBaseline:
    """``factory(*args)`` runs in the child and returns ``(function, info)``; each call of this object
    sends its arguments there and returns what ``function`` returned (``info``: what the factory says
    about itself, e.g. the library's version). Raises ``BaselineFailed`` once the child is gone."""

    def __init__(self, name: str, factory: Callable[..., tuple[Callable, Any]], *args: Any) -> None:
        self.name = name
        spawn = multiprocessing.get_context("spawn")
        self._connection, theirs = spawn.Pipe()
        self._process = spawn.Process(target=_serve, args=(theirs, os.getpid(), factory, args), daemon=True,
                                      name=f"baseline-{name}")
        self._process.start()
        theirs.close()  # the child's end: once the child is gone, a read here ends (EOF) instead of waiting
        self.info = self._answer("while starting")

    def __call__(self, *args: Any) -> Any:
        try:
            self._connection.send(args)
        except OSError:
            pass  # gone: the answer says why
        return self._answer("during a call")

    def _answer(self, when: str) -> Any:
        try:
            failed, value = self._connection.recv()
        except (EOFError, OSError):
            self._process.join(10)
            raise BaselineFailed(f"{self.name}'s process {_ended(self._process.exitcode)} {when}") from None
        if failed:
            raise BaselineFailed(f"{self.name} failed {when}: {value}")
        return value

    def close(self) -> None:
        self._connection.close()  # the child reads EOF and returns
        self._process.join(10)
        if self._process.exitcode is None:
            self._process.kill()


def _ended(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _serve(connection, parent: int, factory: Callable, args: tuple) -> None:
    """The child: build the function, then answer calls until the bench closes its end."""
    die_with(parent, signal.SIGKILL)
    try:
        function, info = factory(*args)
        connection.send((False, info))
    except Exception as exc:
        connection.send((True, repr(exc)))
        return
    while True:
        try:
            call = connection.recv()
        except EOFError:
            return
        try:
            connection.send((False, function(*call)))
        except Exception as exc:
            connection.send((True, repr(exc)))
