"""The Backend interface every backend honours: each declares how it provides workers and does so, lists its pods
until it stops them, and start_workers launches or attaches through that interface only."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from fakes.kubernetes_api import RecordingCoreV1, RecordingNetworkingV1

from worker import constants as c
from worker.backends import BACKENDS, Backend, Resources, WorkerHandle, make_backend
from worker.cluster import start_workers
from worker.errors import WorkerError
from worker.registration import Registration
from worker.rendezvous.client import register
from worker.rendezvous.token import new_token
from worker.sshd import generate_keypair

# The declared interface (worker/backends/base.py): all a caller may use of a backend.
DECLARED = {name for name in dir(Backend) if not name.startswith("_")}


@pytest.fixture
def each_backend(request, cml_emulator, static_hosts_file, monkeypatch):
    """Every backend in BACKENDS, built as a user would (cml on the emulator, kubernetes on the stand-in, slurm on a
    real two-node Slurm started for the test)."""
    monkeypatch.setenv("CDSW_IP_ADDRESS", "10.1.0.4")
    monkeypatch.setenv("POD_IP", "10.2.0.4")
    options = {
        "local": {"sshd": False},
        "cml": {},
        "kubernetes": {
            "image": "img",
            "api": RecordingCoreV1(),
            "networking_api": RecordingNetworkingV1(),
            "poll_s": 0.01,
        },
        "static": {"hosts": static_hosts_file, "known_hosts": static_hosts_file.with_name("known_hosts")},
        "slurm": {"poll_s": 0.2},
    }
    if request.param == "slurm":
        request.getfixturevalue("slurm_cluster")
    backend = make_backend(request.param, **options[request.param])
    yield backend
    backend.stop()


@pytest.fixture
def static_hosts_file(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.2 slots=2\n127.0.0.3 slots=1\n")
    return hostfile


# A real Slurm cluster takes a few seconds to start: its runs are slow tests.
@pytest.mark.parametrize(
    "each_backend",
    [pytest.param(name, marks=pytest.mark.slow) if name == "slurm" else name for name in BACKENDS],
    indirect=True,
)
def test_every_backend_declares_how_it_provides_workers_and_honours_it(each_backend):
    backend = each_backend
    assert isinstance(backend, Backend) and backend.name in BACKENDS and isinstance(backend.attaches, bool)
    assert list(backend.pods) == []
    assert backend.ssh_port(2200, 2) == 2200 and 1 <= backend.ssh_port(None, 2) <= 65535
    if backend.attaches:
        # Host keys come from a known_hosts the user trusts; there is no agent to launch or address to give.
        assert backend.known_hosts is not None
        with pytest.raises(WorkerError, match="attaches to hosts that already run sshd; it launches nothing"):
            backend.launch(1, Resources(), {})
        with pytest.raises(WorkerError, match="asked for 5 workers but the static host list has 2"):
            backend.attach(5, 22)
    else:
        # Host keys arrive over the rendezvous; the run makes the client key.
        assert backend.known_hosts is None and backend.identity_file is None
        ipaddress.ip_address(backend.rendezvous_host())
        ipaddress.ip_address(backend.advertised_address())
        with pytest.raises(WorkerError, match="launches its workers; it has no existing hosts to attach to"):
            backend.attach(1, 22)
        backend.wait(0)  # nothing launched yet: nothing to wait for
        assert backend.failures() == {}
    backend.stop()
    backend.stop()  # idempotent, also before anything started
    with backend as entered:
        assert entered is backend


@pytest.mark.parametrize(
    "each_backend",
    [
        pytest.param("local", marks=pytest.mark.slow),
        pytest.param("cml", marks=pytest.mark.slow),
        "kubernetes",
        pytest.param("slurm", marks=pytest.mark.slow),
    ],
    indirect=True,
)
def test_every_launching_backend_lists_its_pods_until_it_stops_them(each_backend, tmp_path):
    """Agents pointed at a master that is not there keep retrying, so they stay up until stop()."""
    token_file = tmp_path / "token"
    new_token(token_file)
    env = {c.ENV_RENDEZVOUS: "127.0.0.1:1", c.ENV_TOKEN_FILE: str(token_file), c.ENV_SSHD: "0", c.ENV_DEADLINE: "60"}
    each_backend.workdir = tmp_path / "workers"
    handles = each_backend.launch(2, Resources(cpu=1, memory_gb=1), env)
    assert len(handles) == 2 and [h.pod for h in each_backend.pods] == [h.pod for h in handles]
    each_backend.wait(30)
    assert each_backend.failures() == {}
    each_backend.stop()
    assert list(each_backend.pods) == [] and each_backend.failures() == {}


def test_a_backend_that_lacks_what_it_declares_is_refused_when_defined():
    with pytest.raises(TypeError, match="HalfStatic declares attaches = True but does not override attach"):

        class HalfStatic(Backend):
            attaches = True

            def stop(self):
                pass

    with pytest.raises(
        TypeError, match="HalfLauncher declares attaches = False but does not override advertised_address"
    ):

        class HalfLauncher(Backend):
            def launch(self, count, resources, env):
                return []

            def stop(self):
                pass


class UsesRecorded:
    """Records which public attributes start_workers touches (the backend's own state is under ``_``)."""

    def __getattribute__(self, name):
        if not name.startswith("_"):
            object.__getattribute__(self, "_used").add(name)
        return object.__getattribute__(self, name)


class InProcessLauncher(UsesRecorded, Backend):
    """A launching backend whose "pods" register from this process, through the real rendezvous client."""

    name = "in-process"

    def __init__(self, host_key: str) -> None:
        self._used: set[str] = set()
        self._host_key = host_key
        self._sessions = []

    def advertised_address(self) -> str:
        return "127.0.0.1"

    def rendezvous_host(self) -> str:
        return "127.0.0.1"

    def launch(self, count, resources, env):
        port = int(env[c.ENV_SSH_PORT])
        for index in range(count):
            registration = Registration(
                address=f"127.0.0.{index + 2}",
                slots=1,
                hostname=f"fake-{index}",
                pod=f"fake-{index}",
                ssh_port=port,
                host_key=self._host_key,
            )
            key = self.pod_key(registration.pod)
            source = registration.address  # each pod connects from its own address
            self._sessions.append(register(env[c.ENV_RENDEZVOUS], key, registration, source=source))
        return [WorkerHandle(f"fake-{index}") for index in range(count)]

    def stop(self) -> None:
        for session in self._sessions:
            session.close()
        self._sessions = []


class InProcessAttacher(UsesRecorded, Backend):
    """An attaching backend whose hosts are described without ssh."""

    name = "in-process-hosts"
    attaches = True

    def __init__(self, host_key: str, known_hosts: Path) -> None:
        self._used: set[str] = set()
        self._host_key = host_key
        self.known_hosts = known_hosts

    def attach(self, count, ssh_port):
        return [
            Registration(
                address=f"127.0.0.{index + 2}",
                slots=2,
                hostname=f"host-{index}",
                pod=f"host-{index}",
                ssh_port=ssh_port,
                host_key=self._host_key,
            )
            for index in range(count)
        ]

    def stop(self) -> None:
        pass


@pytest.fixture
def host_key(tmp_path):
    return " ".join(generate_keypair(tmp_path / "host_key", "host").split()[:2])


def test_start_workers_launches_through_the_declared_interface_only(host_key, tmp_path):
    backend = InProcessLauncher(host_key)
    with start_workers(backend, 2, tmp_path / "run", timeout=20, ssh_port=2200) as cluster:
        assert cluster.hostfile.read_text() == "127.0.0.2 slots=1\n127.0.0.3 slots=1\n"
        assert cluster.known_hosts.read_text() == f"[127.0.0.2]:2200 {host_key}\n[127.0.0.3]:2200 {host_key}\n"
        assert cluster.identity_file == tmp_path / "run" / c.IDENTITY_NAME and cluster.rendezvous[0] == "127.0.0.1"
    assert backend._used <= DECLARED, backend._used - DECLARED
    assert {
        "launch",
        "advertised_address",
        "rendezvous_host",
        "wait",
        "stop",
    } <= backend._used and "attach" not in backend._used


def test_start_workers_attaches_through_the_declared_interface_only(host_key, tmp_path):
    backend = InProcessAttacher(host_key, tmp_path / "trusted_known_hosts")
    with start_workers(backend, 2, tmp_path / "run", ssh_port=22) as cluster:
        assert cluster.hostfile.read_text() == "127.0.0.2 slots=2\n127.0.0.3 slots=2\n"
        assert cluster.known_hosts.read_text() == f"127.0.0.2 {host_key}\n127.0.0.3 {host_key}\n"
        assert cluster.identity_file is None and cluster.rendezvous == ("", 0)
    assert backend._used <= DECLARED, backend._used - DECLARED
    assert {"attach", "identity_file", "stop"} <= backend._used and not {"launch", "advertised_address"} & backend._used
    # Attached hosts have their own keys and sshd: no run token or client key is made for them.
    assert not (tmp_path / "run" / c.TOKEN_NAME).exists() and not (tmp_path / "run" / c.IDENTITY_NAME).exists()
