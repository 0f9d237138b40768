"""Child processes that end with the process that started them, even when it is killed by SIGKILL (Linux's
PR_SET_PDEATHSIG; elsewhere nothing is done).

The kernel sends the signal when the *thread* that forked the child ends, not its process: a child started
by a short-lived thread (a fault injector's restart of Redis) would be ended with that thread. So
``spawn_ending_with_this_process`` forks on a thread of its own that lives as long as the process. The
setting is made in the child after the fork's exec, never between fork and exec (a ``preexec_fn``): there
a process with other threads may find their locks held, and a child of the supervisor aborted so.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

PR_SET_PDEATHSIG = 1
# run by a fresh interpreter: set the signal, check the parent is still the one that started it, then become
# the program (the setting outlives exec); argv: parent pid, signal, the program's command line
_PROLOGUE = ("import ctypes, os, sys; parent, sig = int(sys.argv[1]), int(sys.argv[2]); "
             f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, sig); os.getppid() == parent or os.kill(os.getpid(), sig); "
             "os.execvp(sys.argv[3], sys.argv[3:])")


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


def ending_with_this_process(command: list[str], sig: int = signal.SIGTERM) -> list[str]:
    """``command`` (a program that cannot call ``die_with`` itself, such as redis-server) as a command line
    whose process gets ``sig`` when this process ends: a Python prologue sets it up and execs the program,
    under the same pid (~20 ms)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-I", "-S", "-c", _PROLOGUE, str(os.getpid()), str(int(sig)), *command]


@functools.cache
def _spawner() -> ThreadPoolExecutor:
    """One thread that forks the children tied to this process: it lives until the interpreter exits."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")


def spawn_ending_with_this_process(command: list[str], sig: int = signal.SIGTERM, **popen) -> subprocess.Popen:
    """``subprocess.Popen(ending_with_this_process(command, sig), **popen)``, forked on the spawner thread,
    whichever thread calls it."""
    return _spawner().submit(subprocess.Popen, ending_with_this_process(command, sig), **popen).result()
