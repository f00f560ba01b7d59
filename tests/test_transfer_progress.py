"""What the supervisor makes of its senders' lines (launcher/transfer.py) while the model is
on its way to the workers: the start's output, and the state `./launch.sh status`, /health
and the dashboard read (ipc/supervisor_state.py). The lines are those launcher/model_sender.py
prints (tests/test_model_transfer.py runs it for real)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from ipc.supervisor_state import SupervisorState, TransferView, print_status, write_state
from launcher import remote
from launcher.transfer import Sender

MIB = 2**20
EVENTS = [
    '{"event":"offer","rank":1,"share":"layers 10-19 (10)","share_bytes":314572800,'
    '"weight_bytes":314000000}',
    '{"event":"inventory","rank":1,"share_bytes":314572800,"have":"partial","directory":'
    '"/Users/ann/.cache/mlx-ring/received/k/s","need_bytes":209715200,"have_bytes":104857600,'
    '"damaged":["share-00001.safetensors#3"],"verified_s":0.4,"free_bytes":53687091200}',
    '{"event":"progress","rank":1,"phase":"sending","done_bytes":157286400,'
    '"total_bytes":314572800,"sent_bytes":52428800,"rate":52428800,"eta_s":3.0}',
]


def _sender(lines: list[str]) -> Sender:
    worker = remote.Worker(rank=1, address="10.0.5.2", dest="ann@mac2", remote_dir="~/mlx-ring")
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdout.write(sys.argv[1])", "\n".join(lines)],
        stdout=subprocess.PIPE,
        text=True,
    )
    sender = Sender(worker, 1, process, TransferView(rank=1, host="ann@mac2", phase="checking"))
    sender.read(threading.Lock())
    process.wait()
    return sender


def test_a_sending_worker_shows_bytes_rate_and_time_left(tmp_path: Path, capsys) -> None:
    sender = _sender(EVENTS)
    assert sender.lines == [
        "rank 1 (ann@mac2) receives: layers 10-19 (10)",
        "rank 1 (ann@mac2) holds 100.0 MiB of its share (checked in 0.4 s, 1 damaged block(s) "
        "to send again), needs 200.0 MiB, 50.00 GiB free in "
        "/Users/ann/.cache/mlx-ring/received/k/s",
    ]
    view = sender.view
    assert view.line() == "rank 1 (ann@mac2): 50% (150.0 MiB of 300.0 MiB), 50.0 MiB/s, 3 s left"
    state = SupervisorState(pid=os.getpid(), phase="starting", since=time.time(), transfer=[view])
    assert state.summary() == (
        "starting the ranks (attempt 1), sending the model: rank 1 (ann@mac2): 50% "
        "(150.0 MiB of 300.0 MiB), 50.0 MiB/s, 3 s left"
    )
    write_state(tmp_path / "supervisor.json", state)
    assert print_status(tmp_path / "supervisor.json") == 1  # not running yet
    out = capsys.readouterr().out
    assert "    model transfer: rank 1 (ann@mac2): 50% (150.0 MiB of 300.0 MiB)" in out


def test_the_outcome_of_each_worker(tmp_path: Path) -> None:
    done = _sender(
        [*EVENTS, '{"event":"done","rank":1,"sent_bytes":209715200,"seconds":4.0,"have":"partial"}']
    )
    assert done.view.phase == "done" and done.view.done_bytes == done.view.total_bytes
    assert done.view.line() == (
        "rank 1 (ann@mac2): holds its model (300.0 MiB of 300.0 MiB); sent 200.0 MiB in 4.0 s "
        "(50.0 MiB/s)"
    )
    refused = _sender(
        [
            EVENTS[0],
            '{"event":"refused","rank":1,"reason":"/Users/ann/.cache/mlx-ring has 1.0 GiB free; '
            'the share needs 300.0 MiB more and 1.00 GiB stays free"}',
        ]
    )
    assert refused.view.line() == (
        "rank 1 (ann@mac2): refused: /Users/ann/.cache/mlx-ring has 1.0 GiB free; the share "
        "needs 300.0 MiB more and 1.00 GiB stays free"
    )
    state = SupervisorState(pid=os.getpid(), phase="starting", since=time.time())
    state.transfer = [refused.view]
    assert "sending the model" not in state.summary()  # nothing on its way
    full = _sender(
        [
            EVENTS[0],
            '{"event":"inventory","rank":1,"have":"full","directory":"/Volumes/models/q",'
            '"need_bytes":0,"have_bytes":0,"damaged":[],"verified_s":0,"free_bytes":1}',
            '{"event":"done","rank":1,"sent_bytes":0,"seconds":0,"have":"full"}',
        ]
    )
    assert full.lines[-1] == (
        "rank 1 (ann@mac2) holds a full copy of the model (/Volumes/models/q): nothing to send"
    )
    assert full.view.note == "nothing to send"
