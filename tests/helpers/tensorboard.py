"""`textsql tensorboard` started as a user starts it, asked for its runs, and stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TEXTSQL = [str(Path(sys.executable).parent / "textsql")]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def serve(logdir: Path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Start `textsql tensorboard` and return it with the URL it printed."""
    process = subprocess.Popen(
        [*TEXTSQL, "tensorboard", "--logdir", str(logdir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 120
    for line in process.stdout:
        match = re.search(r"(http://\S+/)", line)
        if match:
            return process, match.group(1)
        if time.monotonic() > deadline:
            break
    process.kill()
    raise AssertionError(f"tensorboard printed no URL (exit {process.wait()})")


def wait_for_run(url: str, run: str) -> list:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        runs = get_json(url + "data/runs")
        if run in runs:
            return runs
        time.sleep(1)
    raise AssertionError(f"run {run!r} never appeared at {url}data/runs (last: {runs})")


def stop(process: subprocess.Popen, signum: int = signal.SIGINT) -> None:
    process.send_signal(signum)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
