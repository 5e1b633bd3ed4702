"""`textsql launch` and `textsql train` as the tests start them, the processes they leave, and what those processes'
command lines show while they run."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Self

BIN = Path(sys.executable).parent
HOSTS = ("127.0.0.2", "127.0.0.3")


def tagged_processes(tag: str) -> list[int]:
    """Pids of processes whose environment holds LAUNCH_TEST_TAG=tag (the ranks of one test)."""
    entry = f"LAUNCH_TEST_TAG={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if entry in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                    found.append(int(name))
            except OSError:
                pass
    return found


def fake_prepared(directory: Path) -> Path:
    """What a launch's check reads of a prepared dataset (textsql.data.tables.check_prepared): the split list
    save_to_disk writes."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation", "test"]}))
    return directory


def on_cluster(cluster_run_dir: Path) -> list[str]:
    """`textsql launch` options for a run directory of its own on the workers a cluster started in another: the
    cluster's hostfile and ssh_config (each launch's --run-dir is its ranks' run directory)."""
    return ["--hostfile", str(cluster_run_dir / "hostfile"), "--ssh-config", str(cluster_run_dir / "ssh_config")]


def textsql_launch(run_dir: Path, *options: str, env: dict[str, str] | None = None) -> list[str]:
    """The `textsql launch` command line for a run dir (the master port: a free one, by default), verbose:
    these tests read the ranks' own output, which the default level keeps to launch.log."""
    return [
        str(BIN / "textsql"),
        "--verbose",
        "launch",
        "--run-dir",
        str(run_dir),
        *[f"--env={key}={value}" for key, value in (env or {}).items()],
        *options,
    ]


def textsql_train(argv: list[str]) -> str:
    """Run ``textsql --verbose train ARGV`` in one process (one thread for torch); fails the test unless it exits 0.

    :returns: its output, stdout then stderr.
    """
    result = subprocess.run(
        [str(BIN / "textsql"), "--verbose", "train", *argv],
        check=False,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return result.stdout + result.stderr


class SecretWatch:
    """While in its ``with`` block: every process command line that holds ``secret`` (``holding``), and the modes a
    private file was seen with (``private_file_modes``), looked at every 0.2 s."""

    def __init__(self, secret: str, private_file: Path | None = None) -> None:
        self.secret, self.private_file = secret.encode(), private_file
        self.holding: list[str] = []
        self.private_file_modes: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for entry in Path("/proc").iterdir():
                try:
                    command = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if self.secret in command:
                    self.holding.append(command.replace(b"\0", b" ").decode(errors="replace"))
            if self.private_file is not None:
                try:
                    self.private_file_modes.add(stat.S_IMODE(self.private_file.stat().st_mode))
                except FileNotFoundError:
                    pass
