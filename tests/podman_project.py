"""A compose project run by podman-compose, for tests/test_compose_podman.py: its commands,
its containers, their healthchecks, and everything it leaves behind on the machine."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import ROOT, wait_until

PODMAN = shutil.which("podman")
#: The one of the test extras (pyproject.toml) beside this Python, else one on PATH.
_BESIDE = Path(sys.executable).with_name("podman-compose")
PODMAN_COMPOSE = str(_BESIDE) if _BESIDE.exists() else shutil.which("podman-compose")


@dataclass(frozen=True)
class Container:
    name: str
    service: str
    state: str
    exit_code: int
    pid: int


class PodmanProject:
    """`podman-compose -p NAME ...` in the repo root, and podman commands on its containers."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.name = name
        self.env = env

    def compose(self, *args: str, timeout: float = 600) -> str:
        """Run podman-compose; its output. podman-compose often exits 0 after a failed
        podman command, so callers check the outcome with podman itself."""
        assert PODMAN_COMPOSE is not None
        return _run([PODMAN_COMPOSE, "-p", self.name, *args], timeout, self.env)

    def podman(self, *args: str, timeout: float = 120) -> str:
        assert PODMAN is not None
        return _run([PODMAN, *args], timeout, self.env)

    def containers(self, service: str | None = None) -> list[Container]:
        rows: list[dict[str, Any]] = json.loads(self.podman(
            "ps", "-a", "--format", "json", "--filter", f"label=io.podman.compose.project={self.name}"))
        found = [Container(row["Names"][0], row["Labels"]["com.docker.compose.service"], row["State"],
                           int(row["ExitCode"]), int(row["Pid"])) for row in rows]
        return sorted((c for c in found if service in (None, c.service)), key=lambda c: c.name)

    def healthy(self, name: str) -> bool:
        """The container's own healthcheck, run now (podman 4.3 runs them from systemd
        timers, which this machine lacks)."""
        assert PODMAN is not None
        check = subprocess.run([PODMAN, "healthcheck", "run", name], capture_output=True, timeout=30)
        return check.returncode == 0

    def wait_healthy(self, names: list[str], timeout: float) -> None:
        pending = set(names)

        def all_healthy() -> bool:
            pending.difference_update({n for n in list(pending) if self.healthy(n)})
            return not pending

        wait_until(all_healthy, timeout, f"healthy containers (still waiting: {pending})")

    def inspect(self, name: str, template: str) -> str:
        return self.podman("inspect", "--format", template, name).strip()

    def logs(self, name: str) -> str:
        assert PODMAN is not None
        out = subprocess.run([PODMAN, "logs", name], capture_output=True, text=True, timeout=60)
        return out.stdout + out.stderr

    def save_logs(self, folder: Path) -> None:
        """Every container's log, one file each (the last test removes the containers)."""
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.log"):
            old.unlink()
        for container in self.containers():
            (folder / f"{container.name}.log").write_text(self.logs(container.name))

    def exec(self, name: str, *command: str) -> str:
        return self.podman("exec", name, *command)

    def leftovers(self) -> dict[str, list[str]]:
        """What the project still has on the machine: containers, pods, volumes, networks."""
        def names(*args: str) -> list[str]:
            return self.podman(*args).split()

        return {
            "containers": names("ps", "-a", "--format", "{{.Names}}",
                                "--filter", f"label=io.podman.compose.project={self.name}"),
            "pods": [p for p in names("pod", "ls", "--format", "{{.Name}}") if p == f"pod_{self.name}"],
            "volumes": [v for v in names("volume", "ls", "--format", "{{.Name}}") if v.startswith(f"{self.name}_")],
            "networks": [n for n in names("network", "ls", "--format", "{{.Name}}") if n.startswith(f"{self.name}_")],
        }

    def remove_everything(self) -> None:
        """After a failed test: remove by force whatever the project left."""
        left = self.leftovers()
        for kind, args in (("containers", ["rm", "-f", "-t", "0"]), ("pods", ["pod", "rm", "-f"]),
                           ("volumes", ["volume", "rm", "-f"]), ("networks", ["network", "rm", "-f"])):
            if left[kind]:
                self.podman(*args, *left[kind])


def _run(argv: list[str], timeout: float, env: dict[str, str]) -> str:
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"{argv} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def pip_build_args() -> str:
    """`podman build` options that let the Dockerfile's `pip install` use this machine's
    package index: its network, and its pip configuration with every file and folder that
    configuration names (CA bundle, constraints, local indexes), mounted read-only."""
    files = [Path(p) for p in (os.environ.get("PIP_CONFIG_FILE", ""), "/etc/pip.conf", "/etc/xdg/pip/pip.conf",
                               "~/.pip/pip.conf", "~/.config/pip/pip.conf") if p]
    files = [f.expanduser() for f in files if f.expanduser().is_file()]
    paths = set(files)
    for file in files:
        config = configparser.ConfigParser()
        config.read(file)
        for section in config.sections():
            for key in ("cert", "client-cert", "constraint", "find-links", "index-url", "extra-index-url"):
                for value in config.get(section, key, fallback="").split():
                    path = Path(value.removeprefix("file://"))
                    if key.endswith("index-url"):
                        path = path.parent  # a local index's pages link to files beside it (../../files)
                    if path.is_absolute() and path.exists():
                        paths.add(path)
    mounts = " ".join(f"--volume {p}:{p}:ro" for p in sorted(paths))
    return f"--network host {mounts}".strip()
