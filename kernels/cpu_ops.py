"""Building and loading the C++ CPU kernels (``cpu/*.cpp``) as ``torch.ops.specmesh_cpu``.

They are compiled once per machine, with the compiler found here, into a directory the caller names (the
runtime uses ``$SPECMESH_CACHE/extensions``; ``make install`` builds them). Where they cannot be built,
``load_cpu_ops`` says why and the runtime computes on de-quantized weights instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from functools import lru_cache
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name("cpu") / name
                for name in ("block_linear.cpp", "tree_attention.cpp", "llama_layer.cpp"))
HEADERS = tuple(Path(__file__).with_name("cpu") / name for name in ("ops.h", "vector_math.h"))


class KernelUnavailable(RuntimeError):
    """The CPU kernels cannot be built on this machine; the message says why."""


def cpu_flags() -> list[str]:
    """Compiler flags for this CPU: AVX2, FMA and F16C where torch says the CPU has AVX2, else portable code."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    return ["-mavx2", "-mfma", "-mf16c"] if capability.startswith("AVX") else []


@lru_cache(maxsize=None)
def load_cpu_ops(build_root: Path, portable: bool = False):
    """Compile (first time, ~30 s) and load the kernels; returns their op namespace, ``torch.ops.specmesh_cpu``.
    ``portable``: the plain C++ paths even on an AVX2 CPU, as ``torch.ops.specmesh_cpu_portable`` (for
    tests). Raises ``KernelUnavailable`` when there is no C++ compiler or the build fails."""
    from torch.utils import cpp_extension

    namespace = "specmesh_cpu_portable" if portable else "specmesh_cpu"
    # -fopenmp: at::parallel_for's threads are torch's own OpenMP pool; -ffp-contract=off: the portable
    # paths' products and sums round as the AVX2 paths' do (no fused multiply-adds the source does not ask)
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", f"-DSPECMESH_OPS={namespace}", *([] if portable else cpu_flags())]
    digest = hashlib.sha256(repr((flags, torch.__version__)).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    key = digest.hexdigest()[:16]
    build_dir = Path(build_root) / f"{namespace}-{key}"
    built = build_dir / f"{namespace}_{key}.so"
    if built.exists():  # the key covers sources, flags and torch: a built library is current (and the
        torch.ops.load_library(str(built))  # directory may be read-only, as in the container image)
        return getattr(torch.ops, namespace)
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
    return getattr(torch.ops, namespace)
