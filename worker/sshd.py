"""A private sshd for one worker: its own config, a fresh host key, one authorized client key.

Runs ``/usr/sbin/sshd -D -e -f CONFIG`` as a child process (root is not needed; as root the
privilege-separation directory /run/sshd is created if missing). Only public-key logins with the
run's client key are accepted; passwords, PAM, every kind of forwarding and user environment files
are off, and ``StrictModes`` is on (the authorized key lives in a private directory in the user's home).
The agent's PATH and a few other variables (``FORWARDED_ENV``) are passed to sessions with
``SetEnv``, so ``ssh worker python ...`` from pdsh finds the same interpreter the pod runs.

Usage::

    with Sshd(workdir, "127.0.0.2", 2222, client_public_key) as sshd:
        print(sshd.host_public_key)
"""

from __future__ import annotations

import ctypes
import getpass
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from worker.constants import (
    FORWARDED_ENV,
    INSTALL_SSH_HINT,
    SSHD_LOGIN_GRACE_S,
    SSHD_PATH,
    SSHD_PER_SOURCE_STARTUPS,
    SSHD_START_TIMEOUT_S,
    STOP_GRACE_S,
)
from worker.errors import WorkerError
from worker.files import last_line, private_dir, private_opener
from worker.processes import descendants, end_processes
from worker.registration import InvalidRegistration, check_host_key

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


# How often the stop looks whether the sessions' processes have exited after SIGTERM.
SESSIONS_POLL_S = 0.05


def require_tool(path: str) -> str:
    """The absolute path of an OpenSSH tool, or a one-line error saying how to install it.

    :param path: an absolute path (``/usr/sbin/sshd``) or a name on PATH (``ssh-keygen``).
    :rtype: str
    """
    found = path if os.path.isabs(path) and os.access(path, os.X_OK) else shutil.which(path)
    if not found:
        raise WorkerError(f"{path} is not installed; {INSTALL_SSH_HINT}")
    return found


def generate_keypair(private_key: Path, comment: str) -> str:
    """Create a fresh ed25519 key pair with ssh-keygen (no passphrase); return the public key line.

    :param private_key: where the private key goes (``.pub`` beside it).
    :param comment: the key's comment.
    :rtype: str
    """
    private_key = Path(private_key)
    for stale in (private_key, private_key.with_name(private_key.name + ".pub")):
        stale.unlink(missing_ok=True)
    subprocess.run(
        [require_tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(private_key)],
        check=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    return private_key.with_name(private_key.name + ".pub").read_text(encoding="utf-8").strip()


def _die_with_parent() -> None:
    # If the agent is killed outright, the kernel sends sshd SIGTERM instead of leaving it behind.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _listen_address(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _quoted(value: str) -> str:
    return '"' + value + '"'


class Sshd:
    """One sshd child process; a context manager that stops it on exit."""

    def __init__(
        self,
        workdir: Path,
        address: str,
        port: int,
        authorized_key: str,
        env: dict[str, str] | None = None,
        keys_dir: Path | None = None,
    ) -> None:
        """
        :param workdir: private directory for the config, host key, pid file and log.
        :param address: the address to listen on.
        :param port: the port to listen on.
        :param authorized_key: the one client public key allowed to log in.
        :param env: environment to forward to sessions (default: this process's ``FORWARDED_ENV``).
        :param keys_dir: where the authorized key goes instead of the home directory (read-only in a pod with
            readOnlyRootFilesystem). Every writable directory there is a volume the kubelet makes 0777, which
            StrictModes refuses, so sshd runs with StrictModes off: the pod has one non-root user and no
            privilege escalation, and the key's own directory is 0700.
        """
        try:
            check_host_key(authorized_key.strip())
        except InvalidRegistration:
            raise WorkerError(
                "the client public key is not an OpenSSH public key line; pass the run's id_ed25519.pub"
            ) from None
        self.workdir = Path(workdir).resolve()
        self.address = address
        self.port = port
        self.authorized_key = authorized_key.strip()
        self.env = dict(os.environ if env is None else env)
        self.host_public_key = ""
        self.keys_dir = keys_dir
        self.log_path = self.workdir / "sshd.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._keys_dir: Path | None = None

    def _write_config(self) -> Path:
        host_key = self.workdir / "ssh_host_ed25519_key"
        self.host_public_key = generate_keypair(host_key, f"textsql-worker@{self.address}")
        # StrictModes checks every directory from the key file up to the home directory (or /): a run
        # dir under /tmp or a shared volume fails it, so the one authorized key lives in a private
        # directory in the user's home, removed by stop().
        if self.keys_dir is not None:
            Path(self.keys_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        self._keys_dir = Path(tempfile.mkdtemp(prefix=".textsql-sshd-", dir=self.keys_dir or Path.home()))
        authorized = self._keys_dir / "authorized_keys"
        authorized.write_text(self.authorized_key + "\n", encoding="utf-8")
        authorized.chmod(0o600)
        forwarded = [
            _quoted(f"{name}={self.env[name]}")
            for name in FORWARDED_ENV
            if self.env.get(name) and not any(c in self.env[name] for c in '"\n\\')
        ]
        lines = [
            f"ListenAddress {_listen_address(self.address, self.port)}",
            f"HostKey {_quoted(str(host_key))}",
            f"PidFile {_quoted(str(self.workdir / 'sshd.pid'))}",
            f"AuthorizedKeysFile {_quoted(str(authorized))}",
            f"AllowUsers {getpass.getuser()}",
            "PubkeyAuthentication yes",
            "AuthenticationMethods publickey",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "PermitEmptyPasswords no",
            "UsePAM no",
            f"StrictModes {'no' if self.keys_dir is not None else 'yes'}",
            "PermitUserEnvironment no",
            "AllowAgentForwarding no",
            "AllowTcpForwarding no",
            "AllowStreamLocalForwarding no",
            "X11Forwarding no",
            "PermitTunnel no",
            "PrintMotd no",
            "PrintLastLog no",
            "MaxStartups 64:30:128",  # pdsh connects to every worker at once
            # One address (a hostile pod) holds at most this many unauthenticated connections, so a flood
            # from it cannot take the slots the master's ssh needs; /32 and /128: each address on its own.
            f"PerSourceMaxStartups {SSHD_PER_SOURCE_STARTUPS}",
            "PerSourceNetBlockSize 32:128",
            f"LoginGraceTime {SSHD_LOGIN_GRACE_S}",  # an idle connection gives its slot back after this
            "LogLevel INFO",
        ]
        if forwarded:
            lines.append("SetEnv " + " ".join(forwarded))
        config = self.workdir / "sshd_config"
        config.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return config

    def start(self, timeout: float = SSHD_START_TIMEOUT_S) -> Self:
        """Generate a fresh host key, write the config, start sshd and wait until it answers.

        :param timeout: seconds to wait for sshd's banner.
        :rtype: Sshd
        :raises WorkerError: if sshd is missing, exits (port taken, bad config) or never answers.
        """
        sshd = require_tool(SSHD_PATH)
        private_dir(self.workdir)
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        config = self._write_config()
        with open(self.log_path, "ab", opener=private_opener) as log:
            self._process = subprocess.Popen(
                [sshd, "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - prctl in the child is the only way; it takes no lock
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self.stop()
                raise WorkerError(
                    f"sshd on {self.address}:{self.port} exited with code {code}: {last_line(self.log_path)}"
                )
            if self._answers():
                logger.info("sshd listening on %s:%d (pid %d)", self.address, self.port, self._process.pid)
                return self
            time.sleep(0.05)
        self.stop()
        raise WorkerError(f"sshd on {self.address}:{self.port} did not answer within {timeout:g}s; see {self.log_path}")

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.address, self.port), timeout=1) as sock:
                return sock.recv(4).startswith(b"SSH-")
        except OSError:
            return False

    @property
    def running(self) -> bool:
        """Whether the sshd process is alive.

        :rtype: bool
        """
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        """End what sshd's sessions run, then stop sshd (SIGTERM, then SIGKILL after a grace period each) and remove
        its key directory. Safe to call twice.

        The sessions go first and with sshd, as they would with the pod: a listener stopped alone leaves its
        sessions' processes (a launcher and its ranks) running on, with nobody left to stop them.
        """
        try:
            if self._process is not None and self._process.poll() is None:
                sshd = self._process.pid
                end_processes(descendants(sshd), lambda: descendants(sshd), STOP_GRACE_S, SESSIONS_POLL_S)
                self._process.terminate()
                try:
                    self._process.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
                logger.info("sshd on %s:%d stopped", self.address, self.port)
        finally:
            self._process = None
            if self._keys_dir is not None:
                shutil.rmtree(self._keys_dir, ignore_errors=True)
                self._keys_dir = None

    def __enter__(self) -> Self:
        return self if self.running else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
