"""What ships is what is tested: the wheel `pip install .` builds (the Docker image's path) holds every
source package and data file, runs the cluster from a fresh environment without the source tree, and the
dependency floors admit only versions the committed generated code imports on."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
# the source folders and the import names their packages ship under (pyproject's package-dir)
SOURCES = {"specmesh": "specmesh", "kernels": "specmesh.kernels", "services": "specmesh.services"}
NOT_SHIPPED = (".md", ".pyi")  # a folder's README; the generated stubs serve the repository's type checks


def source_files() -> list[str]:
    """The repository's files as a clone would have them, with what is new and not ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return [path for path in listed if path and (ROOT / path).is_file()]


def shipped_name(path: str) -> str | None:
    """Where a source file lands in the wheel (None: outside the packages)."""
    top, _, rest = path.partition("/")
    if top not in SOURCES or not rest:
        return None
    return "/".join([*SOURCES[top].split("."), rest])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from a copy of the source tree (a build writes build/ and egg-info beside it)."""
    tree = tmp_path_factory.mktemp("source")
    for path in source_files():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, tree / path)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(tree)], check=True, capture_output=True)
    (built,) = out.glob("specmesh-*.whl")
    return built


def test_the_wheel_holds_every_source_package_and_data_file(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    files = [path for path in source_files() if shipped_name(path) and not path.endswith(NOT_SHIPPED)]
    assert any(path.startswith("specmesh/cluster/pipeline/") for path in files)  # the listing reaches subpackages
    missing = sorted(path for path in files if shipped_name(path) not in names)
    assert not missing, f"source files the wheel leaves out (pyproject's packages / package-data): {missing}"


@pytest.mark.slow
def test_the_installed_wheel_runs_the_cluster_demo(wheel: Path, tmp_path: Path):
    """pip installs the wheel into a new environment, which borrows this one's dependencies (not its
    editable specmesh: a path a .pth adds is not scanned for .pth files), and `specmesh up` runs from it, in
    a folder without the sources, to the demo's answer, identical with and without speculation."""
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], check=True)
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([python, "-c", "import specmesh.cluster.pipeline as p; print(p.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where
    run = subprocess.run([env_dir / "bin" / "specmesh", "up", "--exit-after-demo", "--port", "0", "--no-http",
                          "--drafter", "ngram", "--max-tokens", "24", "--log-dir", str(tmp_path / "logs")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for label in ("open", "grounded"):  # each demo request, speculative beside plain
        assert f"[{label} request without speculation:" in run.stdout, run.stdout[-3000:]
    assert run.stdout.count("outputs identical") == 2, run.stdout[-3000:]


def generated_versions() -> tuple[Version, Version]:
    """(grpcio, protobuf): the oldest runtimes the committed specmesh/v1 code imports on."""
    grpc_versions, protobuf_versions = set(), set()
    for path in (ROOT / "specmesh" / "v1").glob("*_pb2*.py"):
        text = path.read_text()
        grpc_versions.update(re.findall(r"GRPC_GENERATED_VERSION = '([\d.]+)'", text))
        protobuf_versions.update(re.findall(r"# Protobuf Python Version: ([\d.]+)", text))
    assert grpc_versions and protobuf_versions, "no version guard found in specmesh/v1"
    return max(map(Version, grpc_versions)), max(map(Version, protobuf_versions))


def floors() -> dict[str, Version]:
    """Each dependency's lowest admitted version (>= or ==)."""
    found = {}
    for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        low = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
        if low:
            found[requirement.name] = max(low)
    return found


def test_the_dependency_floors_admit_only_runtimes_the_generated_code_imports_on():
    grpc_version, protobuf_version = generated_versions()
    found = floors()
    grpc_packages = [name for name in found if name.startswith("grpcio")]
    assert {"grpcio", "grpcio-tools", "grpcio-status"} <= set(grpc_packages)
    too_low = {name: str(found[name]) for name in grpc_packages if found[name] < grpc_version}
    assert not too_low, f"specmesh/v1 was generated for grpcio {grpc_version}; these floors admit older: {too_low}"
    assert found["protobuf"] >= protobuf_version, (f"specmesh/v1 needs protobuf >= {protobuf_version}; pyproject "
                                                   f"admits {found['protobuf']}")
