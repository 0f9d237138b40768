"""A baseline for ``specmesh.bench.isolated`` whose native code dies of an illegal instruction: kept out of the
test modules so that its process imports nothing else."""

import os
import resource
import signal


def crash() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
    os.kill(os.getpid(), signal.SIGILL)


def crashing_decoder(calls: int):
    """A decoder (prompt ids, max tokens, eos ids) -> the prompt's first tokens, which crashes at its call
    ``calls`` + 1 (0: as it starts); and its build."""
    left = [calls]

    def decode(prompt_ids, max_tokens, eos):
        left[0] -= 1
        if left[0] < 0:
            crash()
        return list(prompt_ids[:max_tokens])

    if not calls:
        crash()
    return decode, {"version": "crashing"}
