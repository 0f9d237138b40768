"""A rendered pod's containers run here as local processes, as the kubelet would run them: the environment
resolved (values, ``$(VAR)`` expansion, Secret keys, the pod's name), Secret and emptyDir volumes as
folders of a temporary directory (paths under their mount points rewritten to them), the image's
entrypoint as this Python. What one machine cannot give as a cluster does is the caller's to say:
``hosts`` (a Service's name:port → a loopback address), ``env`` (overrides: listen addresses, the
device) and extra arguments."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from specmesh.cluster.redis_server import redis_server_binary

ENTRYPOINT = [sys.executable, "-m"]  # the image's (Dockerfile: ENTRYPOINT ["python", "-m"])
BINARIES = {"redis-server": redis_server_binary}  # commands of other images, found here
REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def secret_data(docs: list[dict], name: str) -> dict[str, bytes]:
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == name]
    data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    data.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
    return data


class LocalPod:
    def __init__(self, workload: dict, docs: list[dict], root: Path, hosts: dict[str, str] | None = None) -> None:
        self.spec = workload["spec"]["template"]["spec"]
        self.name = f"{workload['metadata']['name']}-0"
        self.namespace = workload["metadata"].get("namespace", "default")
        self.docs = docs
        self.hosts = hosts or {}
        self.volumes = {v["name"]: self._volume(v, root / v["name"]) for v in self.spec.get("volumes", [])}

    def _volume(self, volume: dict, folder: Path) -> Path:
        folder.mkdir(parents=True)
        if "secret" in volume:
            for key, value in secret_data(self.docs, volume["secret"]["secretName"]).items():
                (folder / key).write_bytes(value)
        elif "emptyDir" not in volume:
            raise ValueError(f"volume {volume['name']}: only Secret and emptyDir volumes run here")
        return folder

    def container(self, name: str) -> dict:
        (found,) = [c for c in self.spec.get("initContainers", []) + self.spec["containers"] if c["name"] == name]
        return found

    def _local(self, container: dict, text: str) -> str:
        """``text`` with mount points replaced by their folders and Service addresses by local ones."""
        mounts = sorted(container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))  # the deepest
        for mount in mounts:
            point = mount["mountPath"]
            if text == point or text.startswith(point + "/"):
                text = str(self.volumes[mount["name"]]) + text[len(point):]
                break
        for host, local in self.hosts.items():
            text = text.replace(host, local)
        return text

    def environment(self, container: dict, overrides: dict[str, str]) -> dict[str, str]:
        # this machine's, less any specmesh setting but where its caches are: the pod's own decide
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_") or k == "SPECMESH_CACHE"}
        own: dict[str, str] = {}
        for entry in container.get("env", []):
            if "value" in entry:
                value = REFERENCE.sub(lambda m: own.get(m.group(1), m.group(0)), entry["value"])
            elif "secretKeyRef" in entry["valueFrom"]:
                ref = entry["valueFrom"]["secretKeyRef"]
                value = secret_data(self.docs, ref["name"])[ref["key"]].decode()
            elif entry["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
                value = self.name
            elif entry["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
                value = self.namespace
            else:
                raise ValueError(f"env {entry['name']}: {entry['valueFrom']} is not resolved here")
            own[entry["name"]] = self._local(container, value)
        return {**env, **own, **overrides}

    def command(self, container: dict, extra_args: Sequence[str] = ()) -> list[str]:
        command = [BINARIES[c]() if c in BINARIES else c for c in container.get("command") or []] or ENTRYPOINT
        return [*command, *(self._local(container, a) for a in container.get("args", [])), *extra_args]

    def run(self, name: str, env: dict[str, str] | None = None, timeout_s: float = 60) -> None:
        """An init container, to its end (it must succeed)."""
        container = self.container(name)
        subprocess.run(self.command(container), env=self.environment(container, env or {}), check=True,
                       timeout=timeout_s, capture_output=True)

    def start(self, name: str, log: Path, env: dict[str, str] | None = None,
              extra_args: Sequence[str] = ()) -> subprocess.Popen:
        container = self.container(name)
        with open(log, "ab") as out:
            return subprocess.Popen(self.command(container, extra_args), env=self.environment(container, env or {}),
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
