"""Process facts (ipc/processes.py, tests/support/process_list.py) through both of their
ways: Linux's /proc and the ps (and lsof) that macOS has, the second forced here on Linux,
where the same POSIX options answer. A gone process is told from one that runs, a zombie
counts as ended, and CPU time grows with work."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from ipc import processes
from tests.support import process_list

WAYS = ["proc", "ps"] if sys.platform == "linux" else ["ps"]


@pytest.fixture(params=WAYS)
def way(request, monkeypatch) -> str:
    if request.param == "ps":
        monkeypatch.setattr(processes, "LINUX", False)
    return request.param


def test_running_gone_and_zombie(way) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        # D too: a process just started may still be reading its files from the disk (seen
        # in a fresh clone's CI, where nothing of the new .venv was in the page cache)
        assert processes.running(child.pid) and processes.state(child.pid) in ("S", "R", "D")
    finally:
        child.kill()
    deadline = time.monotonic() + 10
    while processes.state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes.state(child.pid) == "Z" and not processes.running(child.pid)  # unreaped
    child.wait()
    assert processes.state(child.pid) is None and not processes.running(child.pid)
    assert processes.cpu_seconds(child.pid) is None and processes.rss_bytes(child.pid) is None


def test_cpu_time_grows_with_work_and_memory_is_read(way) -> None:
    busy = "import time\nend = time.process_time() + 1.2\nwhile time.process_time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", busy + "\ntime.sleep(30)"])
    try:
        time.sleep(2.5)
        used = processes.cpu_seconds(child.pid)
        assert used is not None and used >= (1.0 if way == "proc" else 1), used
        rss = processes.rss_bytes(child.pid)
        assert rss is not None and rss > 1 << 20, rss
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(sys.platform == "linux" and not shutil.which("lsof"), reason="no lsof")
@pytest.mark.parametrize("lister", ["_linux", "_ps_and_lsof"])
def test_a_projects_processes_are_found_by_command_line_and_directory(tmp_path, lister):
    if lister == "_linux" and sys.platform != "linux":
        pytest.skip("/proc is Linux's")
    listing = getattr(process_list, lister)
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    by_dir = subprocess.Popen(sleeper, cwd=tmp_path)
    by_name = subprocess.Popen([*sleeper, str(tmp_path / "marker")])
    try:
        # Popen returns once the child's exec closed its error pipe, which the kernel does
        # before it sets the new program's arguments: /proc/PID/cmdline can read empty for
        # that moment (a fresh clone's CI found the child by directory, not by name)
        deadline = time.monotonic() + 5
        while True:
            found = {
                pid
                for pid, command, cwd, state in listing()
                if state != "Z" and (str(tmp_path) in command or cwd == str(tmp_path))
            }
            if found == {by_dir.pid, by_name.pid} or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert found == {by_dir.pid, by_name.pid}, found
    finally:
        for child in (by_dir, by_name):
            child.kill()
            child.wait()
    assert not [p for p in process_list.project_processes(tmp_path) if p[0] != os.getpid()]
