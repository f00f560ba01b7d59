"""Runs tests/support/logits_probe.py on 1 rank (a plain process) or N ranks (mlx.launch,
ring backend, 127.0.0.1) and fails the calling test with the probe's log tail."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from launcher import cpu_layer
from launcher.command import ROOT as PROJECT_DIR
from launcher.command import VENV_BIN, Job
from launcher.hostfile import random_free_port_run

PROBE = PROJECT_DIR / "tests" / "support" / "logits_probe.py"


@dataclass(frozen=True)
class Case:
    """One split of one model: what the probe runs and the plan strategy a test expects."""

    model: str
    ranks: int
    parallelism: str
    weights: list[float] | None
    strategy: str

    @property
    def name(self) -> str:
        return f"{self.model}_{self.parallelism}{self.ranks}{'w' if self.weights else ''}"

    @property
    def quantized(self) -> bool:
        return "_q4" in self.model or "mxfp4" in self.model

    @property
    def steps(self) -> int:
        """Greedy tokens compared. Three ranks share this host's two cores, so each ring
        all_sum waits for a rank to be scheduled: a 3-rank case took 3-27 s against 1-8 s
        at 2 ranks (2026-11-25). They compare 8 tokens; 2 ranks show the equality at length."""
        return 8 if self.ranks > 2 else 32

    def spec(self) -> dict:
        """The probe's entry for this case (its `model` still a key of the caller's models)."""
        return {
            "name": self.name,
            "model": self.model,
            "parallelism": self.parallelism,
            "weights": self.weights,
            "steps": self.steps,
        }


def _environment(ranks: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return env | cpu_layer.preload(env) | cpu_layer.threads(ranks, env)


def run_probe(spec: dict, out: Path, ranks: int, timeout: float) -> None:
    """Run the probe on `ranks` ranks (1: a plain process); fail with its log tail."""
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = out / "probe.log"
    program = [str(PROBE), str(spec_path), str(out)]
    command = [str(VENV_BIN / "python"), *program]
    if ranks > 1:
        port = random_free_port_run(ranks)
        command = Job(program=program, port=port, ranks=ranks).argv()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=PROJECT_DIR,
            env=_environment(ranks),
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    # A plain process (one rank) has no relay loop to stop.
    deadline, nudged = time.monotonic() + timeout, ranks == 1
    try:
        while process.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                pytest.fail(f"probe on {ranks} ranks timed out:\n{tail(log_path)}")
            if not nudged and log_path.read_text(errors="replace").count("stdin detached") >= ranks:
                # Every rank closed its stdin: one byte stops mlx.launch's busy relay loop.
                with contextlib.suppress(OSError):
                    process.stdin.write(b"\n")
                    process.stdin.flush()
                nudged = True
            time.sleep(0.2)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        with contextlib.suppress(OSError):
            process.stdin.close()
    assert process.returncode == 0, f"probe on {ranks} ranks failed:\n{tail(log_path)}"


def tail(path: Path, lines: int = 30) -> str:
    text = path.read_text(errors="replace").splitlines()
    kept = [line for line in text if not line.startswith("[ring]")]
    return "\n".join(kept[-lines:])
