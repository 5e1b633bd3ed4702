"""The `textsql rendezvous serve` command line the tests start a master with."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

TEXTSQL = shutil.which("textsql", path=str(Path(sys.executable).parent))


def serve_command(expect: int, port: int, token_file: Path, hostfile: Path, *options: str) -> list[str]:
    """``textsql rendezvous serve`` on 127.0.0.1 for ``expect`` workers; ``options`` add ``--timeout``, ``--hold``..."""
    assert TEXTSQL is not None, "the venv's textsql entry point is missing: pip install -e ."
    return [
        TEXTSQL,
        "rendezvous",
        "serve",
        "--expect",
        str(expect),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--token-file",
        str(token_file),
        "--hostfile",
        str(hostfile),
        *options,
    ]
