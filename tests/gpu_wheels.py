"""`make gpu-wheels`: the wheels a stock CUDA image lacks for specmesh, downloaded here for the device's Python.

A GPU machine is lent for ~15 minutes with no network; its image holds PyTorch, Triton, transformers and
grpcio but not pydantic, fastapi, redis, kubernetes and the rest, so every `specmesh` command would stop at
import. This walks specmesh's run-time requirements as installed here (the exact versions in use), leaves out
what the image has (`gpu_image_packages.txt`) and what only builds (`BUILD_ONLY`), and downloads each of the
rest, as a binary wheel for CPython 3.12 on manylinux x86-64, into `.whl/`. `tests/gpu_checks.sh` installs
what it finds there (into /tmp/site, ahead of the image's own) before anything runs. Name `.whl` in the
device call's `carry`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
IMAGE_PACKAGES = HERE / "gpu_image_packages.txt"
BUILD_ONLY = {"specmesh", "grpcio-tools"}  # the project itself travels as source; grpcio-tools makes specmesh/v1
# in the image, but perhaps older than the generated specmesh/v1 code accepts (tests/test_packaging.py)
ALWAYS = {"grpcio", "protobuf"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    """The image's distributions, canonical names."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return {canonicalize_name(line) for line in lines if line and not line.startswith("#")}


def closure(root: str = "specmesh") -> dict[str, str]:
    """{canonical name: installed version} of ``root`` and everything it needs at run time (no extras)."""
    found: dict[str, str] = {}
    pending = [root]
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found:
            continue
        dist = metadata.distribution(name)  # raises when a requirement is not installed here: install first
        found[name] = dist.version
        for line in dist.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return found


def plan(needed: dict[str, str], image: set[str]) -> dict[str, str]:
    """What to carry: every needed distribution the image lacks, and ``ALWAYS``, at the version in use."""
    return {name: version for name, version in sorted(needed.items())
            if name not in BUILD_ONLY and (name not in image or name in ALWAYS)}


def download(wheels: dict[str, str], into: Path, python_version: str = "3.12") -> list[str]:
    """Each wheel into ``into`` (one pip call each, so a failure names its package); the names that failed."""
    failed = []
    for name, version in wheels.items():
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--python-version", python_version, "--implementation", "cp", "-d", str(into),
                   *(flag for platform in PLATFORMS for flag in ("--platform", platform)), f"{name}=={version}"]
        if subprocess.run(command).returncode != 0:
            failed.append(f"{name}=={version}")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--into", type=Path, default=Path(".whl"), help="the folder (emptied first; default .whl)")
    parser.add_argument("--python-version", default="3.12", help="the device's Python (default 3.12)")
    parser.add_argument("--list", action="store_true", help="print what would be carried, download nothing")
    args = parser.parse_args(argv)
    wheels = plan(closure(), image_packages())
    if args.list:
        print("\n".join(f"{name}=={version}" for name, version in wheels.items()))
        return 0
    args.into.mkdir(exist_ok=True)
    for old in args.into.glob("*.whl"):
        old.unlink()
    failed = download(wheels, args.into, args.python_version)
    files = sorted(args.into.glob("*.whl"))
    size = sum(f.stat().st_size for f in files)
    print(f"{len(files)} wheels, {size / 2**20:.1f} MiB in {args.into}/ (carry it: the device takes 64 MiB in all)")
    if failed:
        print("no wheel for:", " ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
