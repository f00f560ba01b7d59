"""A cluster whose ranks 1.. run on namespaced hosts (tests/support/netns_hosts.py, real
sshd, ranks reached over the test bridge as over a cable), optionally behind a delayed,
capped link (bench/delayed_link.py): the benchmarks' stand-in for Macs on Thunderbolt.

    with NetnsCluster(model, ranks=3, env={...}, delay_us=150, gbps=10) as cluster: ...

Rank 0 runs here on the bridge's address; every host shares this machine's files, so each
rank runs this project's venv in this directory (no sync). Needs root, like the remote-mode
tests. Used by bench/step_time.py (`--netns`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from bench.delayed_link import DelayedLinks
from launcher import cpu_layer
from launcher.command import ROOT, VENV_BIN, Job
from launcher.local_cluster import Cluster
from tests.support import netns_hosts
from tests.support.netns_hosts import GATEWAY, NetnsHosts

# What a remote rank needs of the caller's environment (an SSH session starts without it).
PASSED = ("MODEL", "ENV_FILE", "PREFIX_CACHE_DIR", "PYTHONUNBUFFERED", "OPENBLAS_NUM_THREADS")


class NetnsCluster(Cluster):
    """Cluster over `ranks - 1` namespaced workers; see the module's docs."""

    def __init__(
        self,
        model: str | Path,
        ranks: int,
        env: dict[str, str] | None = None,
        delay_us: float = 0.0,
        gbps: float = 0.0,
    ) -> None:
        super().__init__(model, ranks=ranks, env=env, ready_timeout=900)
        reason = netns_hosts.unavailable()
        if reason:
            raise RuntimeError(f"namespaced hosts cannot be made here: {reason}")
        self.hosts = NetnsHosts(count=ranks - 1)
        self.delay_us, self.gbps = delay_us, gbps
        self.links: DelayedLinks | None = None

    def environment(self) -> dict[str, str]:
        env = super().environment()
        real = shutil.which("ssh", path=str(self.hosts.bin)) or str(self.hosts.bin / "ssh")
        env["MLX_RING_REAL_SSH"] = real  # scripts/ssh-wrapper/ssh, then our keys' ssh
        env["PATH"] = f"{ROOT / 'scripts' / 'ssh-wrapper'}:{self.hosts.bin}:{env['PATH']}"
        return env

    def command(self) -> list[str]:
        hostfile = self.workdir / "hosts.json"
        entries = [{"ssh": "127.0.0.1", "ips": [GATEWAY]}] + [
            {"ssh": w.address, "ips": [w.address]} for w in self.hosts.workers
        ]
        hostfile.write_text(json.dumps(entries))
        env = self.environment()
        rank_env = {k: env[k] for k in PASSED if k in env}
        rank_env |= {k: v for k, v in self.extra_env.items()}
        rank_env[cpu_layer.SWITCH] = env.get(cpu_layer.SWITCH, "auto")
        job = Job(
            program=[str(ROOT / "server.py")],
            port=self.port,
            hostfile=hostfile,
            # every host: the CPU layer's preload (launcher/command.py exec), then server.py
            python=[str(VENV_BIN / "python"), "-m", "launcher.command", "exec", "--"],
            cwd=ROOT,
            rank_env=rank_env,
        )
        return job.argv()

    def __enter__(self) -> NetnsCluster:
        self.hosts.up()
        try:
            if self.delay_us or self.gbps:
                self.links = DelayedLinks(self.hosts, self.delay_us, self.gbps).__enter__()
            super().__enter__()
        except BaseException:
            self._down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._down()

    def _down(self) -> None:
        if self.links is not None:
            self.links.__exit__()
        self.hosts.down()

    def relay_report(self) -> dict[str, Any]:
        return self.links.report if self.links is not None else {"asked_us": 0.0}
