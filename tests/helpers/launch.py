"""`textsql launch` as the launch, supervision and recovery tests start it, and the processes it leaves."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
