"""What `start` records and what `restart`, `status` and the other commands take from it
(launcher/settings_record.py), on files in a temporary project directory."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from launcher.paths import Paths
from launcher.settings_record import changes, exports, read_env, record, show


def _started(tmp_path: Path, environ: dict[str, str], in_force: str) -> Paths:
    paths = Paths(root=tmp_path)
    settings = tmp_path / "settings.env"
    settings.write_text(in_force)
    assert record(paths, environ, settings) == 0
    return paths


def test_start_records_the_settings_of_its_environment_alone(tmp_path: Path) -> None:
    environ = {"MODEL": "/models/m", "num_devices": "2", "PATH": "/bin", "ENV_FILE": "/e"}
    paths = _started(tmp_path, environ, "MODEL=/models/m\nNUM_DEVICES=2\nAPI_KEY=s3cret\n")
    assert read_env(paths.run / "started.env") == {
        "MODEL": "/models/m",
        "num_devices": "2",
        "ENV_FILE": "/e",
    }
    assert (paths.run / "started.env").stat().st_mode & 0o777 == 0o600
    assert read_env(paths.run / "in-force.env")["NUM_DEVICES"] == "2"


def test_a_later_command_takes_what_its_environment_does_not_set(tmp_path: Path) -> None:
    paths = _started(tmp_path, {"MODEL": "/my models/m's", "NUM_DEVICES": "2"}, "")
    lines = exports(paths, {"NUM_DEVICES": "3"})
    assert lines == ["export MODEL='/my models/m'\"'\"'s'"]
    shell = "; ".join([*lines, 'printf %s "$MODEL"'])
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True)
    assert done.stdout == "/my models/m's"  # quoted for the shell that evaluates it
    assert shlex.split(lines[0].removeprefix("export "))[0] == "MODEL=/my models/m's"


def test_a_setting_with_a_line_break_is_refused(tmp_path: Path) -> None:
    (tmp_path / "settings.env").write_text("")
    assert record(Paths(root=tmp_path), {"API_KEY": "a\nb"}, tmp_path / "settings.env") == 2


def test_changes_name_each_setting_that_differs_and_hide_the_key() -> None:
    old = {"NUM_DEVICES": "2", "MODEL": "/m", "API_KEY": "one"}
    new = {"NUM_DEVICES": "3", "MODEL": "/m", "API_KEY": "two"}
    assert changes(old, new) == ["NUM_DEVICES: 2 -> 3", "API_KEY: (set) -> (set)"]
    assert changes(new, new) == []


def test_status_shows_what_is_not_a_default_and_what_restart_keeps(tmp_path: Path) -> None:
    paths = _started(tmp_path, {"NUM_DEVICES": "3"}, "NUM_DEVICES=3\nMAX_BATCH_SIZE=8\n")
    shown = show(paths)
    assert shown[0] == "settings in force (not the defaults): NUM_DEVICES=3"
    assert shown[1].endswith("given in the environment at start (restart keeps them): NUM_DEVICES")
    assert show(Paths(root=tmp_path / "never"))[0].startswith("settings: none recorded")
