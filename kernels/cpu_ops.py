"""Building and loading the C++ CPU kernels (``cpu/*.cpp``) as ``torch.ops.specmesh_cpu``.

They are compiled once per machine, with the compiler found here, into a directory the caller names (the
runtime uses ``$SPECMESH_CACHE/extensions``; ``make install`` builds them). Where they cannot be built,
``load_cpu_ops`` says why and the runtime computes on de-quantized weights instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("cpu") / name
                for name in ("block_linear.cpp", "tree_attention.cpp", "llama_layer.cpp"))
HEADERS = tuple(Path(__file__).with_name("cpu") / name for name in ("ops.h", "vector_math.h"))


class KernelUnavailable(RuntimeError):
    """The CPU kernels cannot be built on this machine; the message says why."""


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
# The builds of the kernels, best first: (name, compiler flags, CPU features it needs as /proc/cpuinfo names
# them). The integer dot products are exact, so every build gives the same bits (tests/test_block_linear.py).
PATHS: tuple[tuple[str, tuple[str, ...], frozenset[str]], ...] = (
    ("avx512vnni", (*_AVX2, "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni"),
     frozenset({"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_vnni"})),
    ("avxvnni", (*_AVX2, "-mavxvnni"), frozenset({"avx2", "fma", "f16c", "avx_vnni"})),
    ("avx2", _AVX2, frozenset({"avx2", "fma", "f16c"})),
    ("portable", (), frozenset()),
)
PATH_NAMES = tuple(name for name, _, _ in PATHS)


@lru_cache(maxsize=None)
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags (Linux); elsewhere AVX2's where torch says the CPU has it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    return frozenset({"avx2", "fma", "f16c"}) if capability.startswith("AVX") else frozenset()


def supported_paths() -> tuple[str, ...]:
    """The builds this CPU can run, best first (``portable`` always)."""
    return tuple(name for name, _, needs in PATHS if needs <= cpu_features())


def forced_path() -> str | None:
    """The build ``$SPECMESH_CPU_KERNEL`` names, or None for ``auto`` (the default)."""
    wanted = os.environ.get("SPECMESH_CPU_KERNEL", "").strip().lower()
    return None if wanted in ("", "auto") else wanted


def chosen_path() -> str:
    """The build the runtime uses: ``$SPECMESH_CPU_KERNEL`` if set (one of ``PATH_NAMES``, for measuring a
    slower path on a faster CPU), else the best this CPU runs."""
    wanted = forced_path()
    if wanted is None:
        return supported_paths()[0]
    if wanted not in PATH_NAMES:
        raise KernelUnavailable(f"SPECMESH_CPU_KERNEL={wanted!r}: must be auto or one of {', '.join(PATH_NAMES)}")
    if wanted not in supported_paths():
        raise KernelUnavailable(f"SPECMESH_CPU_KERNEL={wanted}: this CPU lacks "
                                f"{', '.join(sorted(dict((n, f) for n, _, f in PATHS)[wanted] - cpu_features()))}")
    return wanted


@lru_cache(maxsize=None)
def load_cpu_ops(build_root: Path, path: str | None = None):
    """Compile (first time, ~30 s) and load the kernels; returns their op namespace. ``path=None``: the runtime's,
    ``torch.ops.specmesh_cpu``: the build ``chosen_path`` names, or the next this CPU runs if that one does not
    compile here (a warning says why). ``path``: that build as ``torch.ops.specmesh_cpu_<path>`` (tests
    compare the builds). Raises ``KernelUnavailable`` when no build compiles (no C++ compiler, say) or this
    CPU cannot run ``path``."""
    if path is not None:
        if path not in supported_paths():
            raise KernelUnavailable(f"the {path} kernels need CPU features this one lacks")
        torch.ops.load_library(str(build_cpu_ops(build_root, path, f"specmesh_cpu_{path}")))
        return getattr(torch.ops, f"specmesh_cpu_{path}")
    candidates = [chosen_path()] if forced_path() else list(supported_paths())
    failures = []
    for candidate in candidates:
        try:
            built = build_cpu_ops(build_root, candidate)
        except KernelUnavailable as exc:
            failures.append(f"{candidate}: {exc}")
            continue
        if failures:
            log.warning("the CPU kernels run as %s: %s", candidate, "; ".join(failures))
        torch.ops.load_library(str(built))
        return torch.ops.specmesh_cpu
    raise KernelUnavailable("; ".join(failures))


def build_cpu_ops(build_root: Path, path: str, namespace: str = "specmesh_cpu") -> Path:
    """The built library of ``path``'s kernels under ``namespace`` (compiled unless already there; any build
    compiles on any x86 CPU, so an image can carry every one). Raises ``KernelUnavailable``."""
    from torch.utils import cpp_extension

    # -fopenmp: at::parallel_for's threads are torch's own OpenMP pool; -ffp-contract=off: the portable
    # paths' products and sums round as the vector paths' do (no fused multiply-adds the source does not ask)
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", f"-DSPECMESH_OPS={namespace}",
             *next(f for name, f, _ in PATHS if name == path)]
    digest = hashlib.sha256(repr((flags, torch.__version__)).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    key = digest.hexdigest()[:16]
    build_dir = Path(build_root) / f"{namespace}-{key}"
    built = build_dir / f"{namespace}_{key}.so"
    if built.exists():  # the key covers sources, flags and torch: a built library is current (and the
        return built  # directory may be read-only, as in the container image)
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler ({compiler!r}) on PATH")
    scripts = str(Path(sys.executable).parent)  # the ninja of a virtualenv that is not activated
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts) is not None:
        os.environ["PATH"] = os.pathsep.join([scripts, os.environ.get("PATH", "")])
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=f"{namespace}_{key}", sources=[str(s) for s in SOURCES], extra_cflags=flags,
            build_directory=str(build_dir), is_python_module=False, verbose=False,
        )
    except (RuntimeError, OSError, ImportError, SystemExit) as exc:  # a failed compile raises RuntimeError
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise KernelUnavailable(f"building the CPU kernels failed: {lines[-1]}") from None
    return built


def build_every_path(build_root: Path) -> None:
    """Build every path's kernels as the runtime would load them (``specmesh_cpu``), each in a process of
    its own (a process can hold one library of a namespace), so that an image runs on any x86 CPU."""
    for name in PATH_NAMES:
        code = f"from pathlib import Path; from specmesh.kernels.cpu_ops import build_cpu_ops; build_cpu_ops(Path({str(build_root)!r}), {name!r})"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if done.returncode:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["failed"]
            raise KernelUnavailable(f"building the {name} kernels failed: {lines[-1]}")
