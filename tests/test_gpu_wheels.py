"""`make gpu-wheels` carries what a stock CUDA image lacks for specmesh to run there: every run-time need of
the installed project (pyproject's dependencies and theirs) is in the image's package list or carried, at the
version in use here; the image's own heavy stack (torch, triton, transformers) is never carried."""

import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).parent))
from gpu_wheels import ALWAYS, BUILD_ONLY, closure, image_packages, plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_every_run_time_need_is_in_the_image_or_carried_at_the_version_in_use():
    needed = closure()
    image = image_packages()
    carried = plan(needed, image)
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for line in dependencies:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        name = canonicalize_name(requirement.name)
        assert name in needed, f"{name}: a dependency of pyproject.toml the installed specmesh does not declare"
        assert name in carried or name in image or name in BUILD_ONLY, f"{name} would be missing on the GPU image"
    assert {name: needed[name] for name in carried} == carried  # the versions installed here
    assert {"pydantic", "pydantic-core", "pydantic-settings", "fastapi", "redis", "kubernetes"} <= set(carried)
    assert ALWAYS <= set(carried)  # in the image, perhaps older than specmesh/v1 was generated for
    assert not {"torch", "triton", "transformers", "specmesh", "grpcio-tools"} & set(carried)


def test_the_image_list_is_a_list_of_distribution_names():
    image = image_packages()
    assert len(image) > 100 and {"torch", "triton", "transformers", "grpcio", "protobuf"} <= image
    assert all(name == canonicalize_name(name) for name in image)
