"""The pod's own user reads the token Secret as the kubelet mounts it for our pod spec, and nobody else may.

No kubelet runs here: the mount is laid out the way the kubelet's atomic writer and fsGroup ownership
lay it out (a timestamped directory, a ``..data`` symlink to it, one symlink per key through
``..data``; files get the Secret's defaultMode plus group read, group = fsGroup), then read by a
process running with the pod's uid and supplementary groups.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
from pathlib import Path

import pytest

from worker import constants as c
from worker.backends import Resources
from worker.backends.kubernetes import TOKEN_MOUNT, KubernetesBackend
from worker.errors import RendezvousError
from worker.rendezvous.token import read_token


def kubelet_secret_mount(root: Path, pod, token: str) -> Path:
    """The token volume of ``pod`` under ``root``, laid out as the kubelet does; returns the key's path."""
    spec = pod.spec
    volume = next(v for v in spec.volumes if v.secret)
    fs_group = spec.security_context.fs_group if spec.security_context else None
    mount = root / TOKEN_MOUNT.lstrip("/")
    stamped = mount / "..2025_01_31_12_00_00.123456789"
    stamped.mkdir(parents=True)
    key = stamped / "token"
    key.write_text(token)
    mode = volume.secret.default_mode
    if fs_group is not None:  # SetVolumeOwnership: group = fsGroup, read-only volume gets group read
        for path in (mount, stamped, key):
            os.chown(path, 0, fs_group)
        mode |= 0o440
        os.chmod(stamped, 0o2755)
    os.chmod(key, mode)
    (mount / "..data").symlink_to(stamped.name)
    (mount / "token").symlink_to("..data/token")
    return mount / "token"


def pod_env(pod) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env if e.value is not None}


@pytest.fixture
def mounted(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("laying out the kubelet's ownership needs root")
    backend = KubernetesBackend(image="img", api=object())
    backend.run_id = "demo-abc123"
    pod = backend.pod_spec(0, Resources(), {c.ENV_TOKEN_FILE: "/x"})
    token = secrets.token_urlsafe(32)
    # Outside pytest's 0700 tmp dirs, so the pod's uid can reach it.
    root = Path(tempfile.mkdtemp(prefix="kubelet-"))
    os.chmod(root, 0o755)
    try:
        yield pod, kubelet_secret_mount(root, pod, token), token
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=True)


def read_as(uid: int, gid: int, groups: list[int], path: Path, group: int) -> str:
    """read_token in a child process that has dropped to ``uid``/``gid``/``groups``, as the agent runs in the pod."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe and never returns
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            os.write(writer, ("ok " + read_token(path, group)).encode())
        except BaseException as error:  # noqa: BLE001 - the forked child reports every failure through the pipe
            os.write(writer, f"error {error}".encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        answer = pipe.read()
    os.waitpid(child, 0)
    return answer


def test_the_pods_user_reads_the_mounted_token_with_the_agents_check(mounted):
    pod, path, token = mounted
    security, env = pod.spec.security_context, pod_env(pod)
    answer = read_as(
        security.run_as_user, security.run_as_group, [security.fs_group], path, int(env[c.ENV_TOKEN_GROUP])
    )
    assert answer == f"ok {token}"


def test_a_group_readable_token_is_refused_for_any_other_group(mounted):
    pod, path, _token = mounted
    assert oct(path.stat().st_mode & 0o777) == "0o440"
    with pytest.raises(RendezvousError, match="readable by others"):
        read_token(path)
    with pytest.raises(RendezvousError, match="readable by others"):
        read_token(path, group=pod.spec.security_context.fs_group + 1)
    os.chmod(path.resolve(), 0o444)
    with pytest.raises(RendezvousError, match="readable by others"):
        read_token(path, group=pod.spec.security_context.fs_group)
