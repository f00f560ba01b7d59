"""hosts.json writer and `detect` (launcher/hostfile.py, launcher/detect.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mlx._distributed_utils.common import Hostfile

from config.settings import PROJECT_DIR, Settings
from launcher import detect
from launcher.hostfile import (
    HostfileError,
    build_hosts,
    ephemeral_start,
    free_port_run,
    random_free_port_run,
    render,
    worker_destinations,
)


def make(**values: object) -> Settings:
    return Settings(_env_file=None, **values)


def test_local_mode_gives_num_devices_ranks_on_loopback(tmp_path: Path) -> None:
    entries = build_hosts(make(num_devices=3))
    assert [e.ssh for e in entries] == ["127.0.0.1"] * 3
    assert all(e.ips == ["127.0.0.1"] and e.weight == 1.0 for e in entries)
    path = tmp_path / "hosts.json"
    path.write_text(render(entries))
    parsed = Hostfile.from_file(path)  # mlx.launch's own reader
    assert [h.ssh_hostname for h in parsed.hosts] == ["127.0.0.1"] * 3
    assert json.loads(path.read_text())[0] == {
        "ssh": "127.0.0.1",
        "ips": ["127.0.0.1"],
        "weight": 1,
    }


def test_weights_follow_rank_weights_and_auto_leaves_them_out() -> None:
    assert [e.weight for e in build_hosts(make(num_devices=3, rank_weights="2,1,1"))] == [2, 1, 1]
    entries = build_hosts(make(num_devices=2, rank_weights="auto"))
    assert all("weight" not in item for item in json.loads(render(entries)))


def test_wrong_number_of_weights_is_refused_with_the_fix() -> None:
    with pytest.raises(HostfileError, match=r"RANK_WEIGHTS has 2 numbers .* 3 ranks.*1,1,1"):
        build_hosts(make(num_devices=3, rank_weights="2,1"))


def test_remote_mode_rank0_is_local_and_workers_follow_in_order() -> None:
    entries = build_hosts(make(worker_hosts="127.0.0.2, 127.0.0.3", worker_ssh="a@m2,b@m3"))
    assert [e.ssh for e in entries] == ["127.0.0.1", "a@m2", "b@m3"]
    assert [e.ips for e in entries] == [["127.0.0.1"], ["127.0.0.2"], ["127.0.0.3"]]


def test_worker_ssh_defaults_to_the_worker_address_and_must_match_in_length() -> None:
    assert worker_destinations(make(worker_hosts="10.0.5.2")) == [("10.0.5.2", "10.0.5.2")]
    with pytest.raises(HostfileError, match="WORKER_SSH has 2 entries but WORKER_HOSTS has 1"):
        worker_destinations(make(worker_hosts="10.0.5.2", worker_ssh="a,b"))


def test_unresolvable_worker_name_is_refused_by_name() -> None:
    with pytest.raises(HostfileError, match="no-such-host.invalid"):
        build_hosts(make(worker_hosts="no-such-host.invalid"))


def test_jaccl_takes_rdma_devices_from_the_distributed_config_file(tmp_path: Path) -> None:
    settings = make(worker_hosts="127.0.0.2", distributed_backend="jaccl")
    rdma = tmp_path / "rdma.json"
    with pytest.raises(HostfileError, match="mlx.distributed_config"):
        build_hosts(settings, rdma_file=rdma)
    rdma.write_text(
        json.dumps(
            [
                {"ssh": "m1", "ips": ["1.1.1.1"], "rdma": [None, "rdma_en3"]},
                {"ssh": "m2", "ips": ["1.1.1.2"], "rdma": ["rdma_en3", None]},
            ]
        )
    )
    entries = build_hosts(settings, rdma_file=rdma)
    assert [e.rdma for e in entries] == [[None, "rdma_en3"], ["rdma_en3", None]]


def test_random_free_port_run_stays_below_the_ephemeral_range() -> None:
    ephemeral = ephemeral_start()  # Linux's /proc, macOS's sysctl
    if ephemeral is None:
        pytest.skip("this system does not say where its ephemeral ports start")
    starts = {random_free_port_run(3) for _ in range(20)}
    assert len(starts) > 1  # random, so side-by-side jobs rarely draw the same ports
    for start in starts:
        assert start >= 20000 and start + 3 <= ephemeral
        for port in range(start, start + 3):
            with socket.socket() as probe:
                probe.bind(("0.0.0.0", port))


def test_free_port_run_returns_consecutive_free_ports() -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        taken = busy.getsockname()[1]
        start = free_port_run(3, start=taken, stop=taken + 50)
    assert start > taken
    for port in range(start, start + 3):
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", port))


def test_cli_writes_hosts_json_and_reports_bad_settings(tmp_path: Path) -> None:
    env = {**os.environ, "ENV_FILE": str(tmp_path / "none.env"), "NUM_DEVICES": "2"}
    out = tmp_path / "hosts.json"
    cmd = [sys.executable, "-m", "launcher.hostfile", "write", "--out", str(out)]
    done = subprocess.run(cmd, cwd=PROJECT_DIR, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(out.read_text())) == 2
    env["RANK_WEIGHTS"] = "1,1,1"
    done = subprocess.run(cmd, cwd=PROJECT_DIR, env=env, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: RANK_WEIGHTS has 3 numbers")


def test_compare_names_each_mismatch_and_its_fix() -> None:
    here = detect.local_facts()
    there = here.model_copy(update={"python": "3.9.6", "mlx": "0.30.0", "free_bytes": 1 << 20})
    problems = detect.compare("mac2", here, there)
    assert any("Python 3.9.6" in p and "install Python" in p for p in problems)
    assert any("mlx 0.30.0" in p and "./launch.sh start" in p for p in problems)
    assert any("GiB free memory" in p for p in problems)
    assert detect.compare("mac2", here, here.model_copy()) == []


def test_detect_names_an_unreachable_host_and_fails() -> None:
    env = {
        **os.environ,
        "ENV_FILE": "/nonexistent",
        "WORKER_HOSTS": "127.0.0.1",
        "WORKER_SSH": "nobody-here@127.0.0.1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "launcher.detect", "--timeout", "3"],
        cwd=PROJECT_DIR,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert done.returncode == 1
    assert "nobody-here@127.0.0.1: unreachable over SSH in BatchMode" in done.stdout
    assert "detect: FAILED" in done.stdout
