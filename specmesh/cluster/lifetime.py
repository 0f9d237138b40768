"""Child processes that end with the process that started them, even when it is killed by SIGKILL (Linux's
PR_SET_PDEATHSIG; elsewhere nothing is done).

The kernel sends the signal when the *thread* that forked the child ends, not its process: start such a
child from the main thread or from one that lives as long as the child should (the supervisor's).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1


@functools.cache
def _prctl():
    return ctypes.CDLL(None, use_errno=True).prctl


def die_with(parent: int, sig: int = signal.SIGTERM) -> None:
    """``sig`` to this process when its parent, the process ``parent``, ends; at once if it already has."""
    if not sys.platform.startswith("linux"):
        return
    _prctl()(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # it ended before the call: this process now belongs to another
        os.kill(os.getpid(), sig)


def dies_with_this_process(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process ends (the setting
    outlives ``exec``, so it covers a program such as redis-server, and a Python service from its first import).
    libc is looked up here: in the forked child, where other threads' locks may be held, only the call is left."""
    if not sys.platform.startswith("linux"):
        return None
    _prctl()
    return functools.partial(die_with, os.getpid(), sig)
