"""Worker hosts for the remote-mode tests: Linux network namespaces, each with its own sshd.

The test owns the subnet 10.77.0.0/24 on this machine: a bridge in the root namespace
holds 10.77.0.1 (rank 0's address), and worker N is namespace `mlxring-wN` at 10.77.0.(N+1)
behind a veth pair on that bridge. The namespaces have no other route, so nothing they
run reaches beyond this machine. Each worker runs Debian's sshd on its own address with a
throwaway host key and accepts one throwaway client key; `bin/ssh` in the work directory
is an ssh that knows both (put it first on PATH: launch.sh, rsync and mlx.launch then use
it), so nothing is written to ~/.ssh. Each worker gets its own REMOTE_DIR.

`down()` removes everything `up()` made, also after a failure: every process inside the
namespaces (by pid), the namespaces, veths, bridge and the work directory. A lock file
serializes test runs that would share the subnet; leftovers of a killed run are removed.

`private` paths (e.g. rank 0's model cache) are what a worker must not share with this
machine: each worker's sshd runs in a mount namespace of its own where every one of them is
an empty tmpfs (of `private_size`), so whatever a worker's session writes there stays on that
worker, as on a separate Mac, and rank 0's files there are out of its sight. `run_in`
runs a command in a worker's mount namespace (to fill, inspect or shrink its disk).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ipc.processes import running

PREFIX = "mlxring"
BRIDGE = f"{PREFIX}-br0"
SUBNET = "10.77.0"
GATEWAY = f"{SUBNET}.1"
SSHD = "/usr/sbin/sshd"
SSH = "/usr/bin/ssh"
LOCK_FILE = Path(tempfile.gettempdir()) / "mlx-ring-netns.lock"
LOCK_WAIT_SECONDS = 900  # another run of these tests may hold the subnet this long


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why these hosts cannot be made here (a skip reason), or None when they can."""
    if not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and sshd need root (run the tests as root)"
    for tool, path in (("ip", shutil.which("ip")), ("sshd", SSHD), ("ssh", SSH)):
        if not path or not os.access(path, os.X_OK):
            return f"{tool} is not installed (apt-get install iproute2 openssh-server)"
    if not shutil.which("rsync") or not shutil.which("ssh-keygen"):
        return "rsync or ssh-keygen is not installed (apt-get install rsync openssh-client)"
    probe = f"{PREFIX}-probe{os.getpid()}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` fails here: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Worker:
    """One namespaced host: its namespace, address, project directory and sshd."""

    index: int
    netns: str
    address: str
    remote_dir: Path
    home: Path  # its sshd's keys, config and log
    sshd: subprocess.Popen | None = None


class NetnsHosts:
    """`count` worker hosts in network namespaces on 10.77.0.0/24; see the module docs."""

    def __init__(
        self, count: int = 2, private: list[Path] | None = None, private_size: str = "4g"
    ) -> None:
        self.count = count
        self.private = [Path(p) for p in private or []]
        self.private_size = private_size
        self.workdir = Path(tempfile.mkdtemp(prefix="mlx-ring-netns-"))
        self.bin = self.workdir / "bin"  # holds `ssh`: put it first on PATH
        self.workers = [
            Worker(
                index=n,
                netns=f"{PREFIX}-w{n}",
                address=f"{SUBNET}.{n + 1}",
                remote_dir=self.workdir / f"w{n}" / "mlx-ring",
                home=self.workdir / f"w{n}" / "sshd",
            )
            for n in range(1, count + 1)
        ]
        self._lock: int | None = None

    # ---- setup ------------------------------------------------------------------------

    def up(self) -> NetnsHosts:
        """Make the network, keys and sshds; on any failure undo it all and re-raise."""
        try:
            self._take_lock()
            self._remove_leftovers()
            self._check_subnet_is_free()
            self._network()
            self._keys()
            for worker in self.workers:
                worker.remote_dir.mkdir(parents=True)
                self.start_sshd(worker)
        except BaseException:
            self.down()
            raise
        return self

    def _take_lock(self) -> None:
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise RuntimeError(
                        f"another test run held {LOCK_FILE} (subnet {SUBNET}.0/24) for "
                        f"{LOCK_WAIT_SECONDS} s; run these tests one at a time"
                    ) from None
                time.sleep(1)
        self._lock = fd

    def _remove_leftovers(self) -> None:
        """Namespaces and the bridge of a run that was killed (we hold the lock: not live)."""
        names = _ip("netns", "list").stdout.split()
        for netns in [n for n in names if n.startswith(f"{PREFIX}-w")]:
            self._end_processes(netns)
            _ip("netns", "del", netns, check=False)
        if _ip("link", "show", BRIDGE, check=False).returncode == 0:
            _ip("link", "del", BRIDGE, check=False)

    def _check_subnet_is_free(self) -> None:
        used = _ip("-4", "-o", "addr", "show").stdout
        if f" {SUBNET}." in used:
            raise RuntimeError(f"{SUBNET}.0/24 is already used on this machine: {used.strip()}")

    def _network(self) -> None:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for worker in self.workers:
            host_end, ns_end = f"{PREFIX}-v{worker.index}", f"{PREFIX}-v{worker.index}p"
            _ip("netns", "add", worker.netns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            _ip("link", "set", host_end, "master", BRIDGE, "up")
            _ip("link", "set", ns_end, "netns", worker.netns)
            _ip("-n", worker.netns, "link", "set", ns_end, "name", "eth0")
            _ip("-n", worker.netns, "addr", "add", f"{worker.address}/24", "dev", "eth0")
            _ip("-n", worker.netns, "link", "set", "eth0", "up")
            _ip("-n", worker.netns, "link", "set", "lo", "up")

    def _keys(self) -> None:
        self.bin.mkdir()
        key = self.workdir / "client_key"
        _keygen(key)
        known = []
        for worker in self.workers:
            worker.home.mkdir(parents=True)
            _keygen(worker.home / "host_key")
            (worker.home / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
            host_pub = (worker.home / "host_key.pub").read_text().split()[:2]
            known.append(f"{worker.address} {' '.join(host_pub)}\n")
            (worker.home / "sshd_config").write_text(_sshd_config(worker))
        (self.workdir / "known_hosts").write_text("".join(known))
        config = self.workdir / "ssh_config"
        config.write_text(
            f"Host {SUBNET}.*\n"
            "    User root\n"
            f"    IdentityFile {key}\n"
            "    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {self.workdir / 'known_hosts'}\n"
            "    GlobalKnownHostsFile /dev/null\n"
            "    StrictHostKeyChecking yes\n"
            "    BatchMode yes\n"
            "    ConnectTimeout 5\n"
            "    LogLevel ERROR\n"
            "Host *\n"
            "    BatchMode yes\n"
            "    ConnectTimeout 5\n"
        )
        wrapper = self.bin / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {SSH} -F {config} "$@"\n')
        wrapper.chmod(0o755)

    # ---- sshd -------------------------------------------------------------------------

    def start_sshd(self, worker: Worker, timeout: float = 10) -> None:
        """Start the worker's sshd (in its namespace) and wait until its port answers."""
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        log = open(worker.home / "sshd.log", "ab")  # noqa: SIM115 (the child keeps it)
        sshd = [SSHD, "-D", "-e", "-f", str(worker.home / "sshd_config")]
        if self.private:  # unshare and sh exec: the pid stays sshd's
            mounts = ""
            for path in self.private:
                path.mkdir(parents=True, exist_ok=True)
                mounts += f"mount -t tmpfs -o size={self.private_size} tmpfs {path} && "
            sshd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                    f'{mounts}exec "$@"', "sh", *sshd]  # fmt: skip
        with log:
            worker.sshd = subprocess.Popen(
                ["ip", "netns", "exec", worker.netns, *sshd],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if worker.sshd.poll() is not None:
                text = (worker.home / "sshd.log").read_text().strip().splitlines()
                raise RuntimeError(f"sshd on {worker.address} exited: {text[-1:]}")
            try:
                with socket.create_connection((worker.address, 22), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"sshd on {worker.address}:22 did not answer within {timeout} s")

    def stop_sshd(self, worker: Worker) -> None:
        """End the worker's sshd listener (sessions it started run on)."""
        if worker.sshd and worker.sshd.poll() is None:
            worker.sshd.terminate()
            try:
                worker.sshd.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.sshd.kill()
                worker.sshd.wait(timeout=5)
        worker.sshd = None

    # ---- inspection -------------------------------------------------------------------

    def run_in(self, worker: Worker, *command: str) -> subprocess.CompletedProcess:
        """`command` in the worker's mount and network namespaces (its sshd's), as root."""
        assert worker.sshd is not None, f"{worker.netns} has no sshd"
        # Without the tests' LD_PRELOAD: OpenBLAS starts threads as it loads, and a
        # threaded process cannot join a mount namespace (setns fails with EINVAL).
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        return subprocess.run(
            ["nsenter", "-t", str(worker.sshd.pid), "-m", "-n", *command],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    def pids(self, worker: Worker) -> list[int]:
        """Every process that runs inside the worker's namespace."""
        done = _ip("netns", "pids", worker.netns, check=False)
        return [int(pid) for pid in done.stdout.split()]

    def commands(self, worker: Worker) -> dict[int, str]:
        """pid -> command line of each process inside the worker's namespace."""
        found = {}
        for pid in self.pids(worker):
            try:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
        return found

    # ---- teardown ---------------------------------------------------------------------

    def down(self) -> None:
        """Remove everything up() made; safe to call twice and after a partial up()."""
        try:
            if self._lock is None:
                return  # nothing was made (the lock comes first)
            for worker in self.workers:
                self.stop_sshd(worker)
                self._end_processes(worker.netns)
                _ip("netns", "del", worker.netns, check=False)
                _ip("link", "del", f"{PREFIX}-v{worker.index}", check=False)
            _ip("link", "del", BRIDGE, check=False)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None

    @staticmethod
    def _end_processes(netns: str) -> None:
        """TERM every process in the namespace by pid, KILL what is left after 5 s."""
        done = _ip("netns", "pids", netns, check=False)
        pids = [int(pid) for pid in done.stdout.split()]
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if running(pid)]
            time.sleep(0.1)
        for pid in pids:
            _signal(pid, signal.SIGKILL)


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "mlx-ring-test", "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )


def _sshd_config(worker: Worker) -> str:
    return (
        f"ListenAddress {worker.address}\n"
        "Port 22\n"
        f"HostKey {worker.home / 'host_key'}\n"
        f"PidFile {worker.home / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {worker.home / 'authorized_keys'}\n"
        "PermitRootLogin prohibit-password\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "PrintMotd no\n"
        "PrintLastLog no\n"
        "MaxStartups 50\n"
        "MaxSessions 50\n"
    )


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
