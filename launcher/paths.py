"""The files launch.sh and the supervisor share in the project directory: logs, pid files
(each pid leads its own process group, so stop can end the whole group), and the
supervisor's state and start progress under run/."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launcher.command import ROOT


class _Under:
    """A path attribute of Paths: `parts` below its project directory (`root`)."""

    def __init__(self, *parts: str) -> None:
        self.parts = parts

    def __get__(self, paths: Paths, owner: type[Paths] | None = None) -> Path:
        return paths.root.joinpath(*self.parts)


@dataclass(frozen=True)
class Paths:
    root: Path = ROOT

    run = _Under("run")
    server_log = _Under("server.log")  # every rank's output, through mlx.launch
    api_log = _Under("api.log")
    supervisor_log = _Under("supervisor.log")
    hosts = _Under("hosts.json")
    ranks_pid = _Under("run", "ranks.pid")  # mlx.launch
    api_pid = _Under("run", "api.pid")
    supervisor_pid = _Under("run", "supervisor.pid")
    state = _Under("run", "supervisor.json")  # ipc/supervisor_state.py
    progress = _Under("run", "start.progress")  # the first start's lines, `./launch.sh start`
    stopped = _Under("run", "stopped.txt")  # what the last stop ended, for `./launch.sh stop`
