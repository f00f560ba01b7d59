"""The files launch.sh and the supervisor share in the project directory: logs, pid files
(each pid leads its own process group, so stop can end the whole group), and the
supervisor's state and start progress under run/."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launcher.command import ROOT


@dataclass(frozen=True)
class Paths:
    root: Path = ROOT

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def server_log(self) -> Path:  # every rank's output, through mlx.launch
        return self.root / "server.log"

    @property
    def api_log(self) -> Path:
        return self.root / "api.log"

    @property
    def supervisor_log(self) -> Path:
        return self.root / "supervisor.log"

    @property
    def hosts(self) -> Path:
        return self.root / "hosts.json"

    @property
    def ranks_pid(self) -> Path:  # mlx.launch
        return self.run / "ranks.pid"

    @property
    def api_pid(self) -> Path:
        return self.run / "api.pid"

    @property
    def supervisor_pid(self) -> Path:
        return self.run / "supervisor.pid"

    @property
    def state(self) -> Path:  # ipc/supervisor_state.py
        return self.run / "supervisor.json"

    @property
    def progress(self) -> Path:  # the first start's lines, for `./launch.sh start`
        return self.run / "start.progress"

    @property
    def stopped(self) -> Path:  # what the last stop ended, for `./launch.sh stop`
        return self.run / "stopped.txt"
