"""worker.ssh: the options every ssh caller uses mean to ssh what they say (read back with `ssh -G`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from textsql.errors import LaunchError
from textsql.launching.hostfile_hosts import HostfileHosts
from textsql.launching.preflight import preflight
from textsql.launching.ranks import RemoteRanks
from worker.cluster import Cluster
from worker.network import free_port
from worker.registration import Registration
from worker.runfiles import format_ssh_config
from worker.ssh import ssh_options


def effective(options: list[str], host: str = "127.0.0.2") -> dict[str, str]:
    """ssh's resolved configuration for host with these options (no connection is made)."""
    result = subprocess.run(["ssh", "-G", *options, host], capture_output=True, text=True, check=True)
    return dict(line.partition(" ")[::2] for line in result.stdout.splitlines())


def test_verified_options_survive_spaces_and_percent_in_paths(tmp_path: Path) -> None:
    directory = tmp_path / "a dir %h"
    directory.mkdir()
    known_hosts, identity = directory / "known_hosts", directory / "id_ed25519"
    config = effective(
        ssh_options(port=2022, user="worker", identity_file=identity, known_hosts=known_hosts, connect_timeout=7)
    )
    assert (config["port"], config["user"], config["connecttimeout"]) == ("2022", "worker", "7")
    assert config["userknownhostsfile"] == str(known_hosts)
    # ssh -G shows IdentityFile before its %-expansion, which happens when the key is loaded.
    assert config["identityfile"] == str(identity).replace("%", "%%") and config["identitiesonly"] == "yes"
    assert (config["stricthostkeychecking"], config["batchmode"], config["passwordauthentication"]) == (
        "true",
        "yes",
        "no",
    )
    assert config["globalknownhostsfile"] == "/dev/null"


def test_the_run_config_and_the_options_agree(tmp_path: Path) -> None:
    """A host reached through the run's ssh_config gets what the same settings on the command line give."""
    worker = Registration.from_dict(
        {
            "address": "127.0.0.2",
            "slots": 1,
            "hostname": "w0",
            "pod": "w0",
            "ssh_port": 2022,
            "user": "worker",
            "host_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBn3VXZ0Q0TDsKy7iCU0DSPkhVTUz3hnNxlsEtkqBHYR",
        }
    )
    known_hosts, identity = tmp_path / "known_hosts", tmp_path / "id_ed25519"
    config = tmp_path / "ssh_config"
    config.write_text(format_ssh_config([worker], identity, known_hosts))
    through_config = effective(ssh_options(config))
    on_command_line = effective(
        ["-F", "/dev/null", *ssh_options(port=2022, user="worker", identity_file=identity, known_hosts=known_hosts)]
    )
    assert through_config == on_command_line
    assert through_config["stricthostkeychecking"] == "true" and through_config["batchmode"] == "yes"


# A host as a hostfile line (or a registration) can name it: were it read as an option, ssh would run its
# ProxyCommand on the master. Each way the master builds an ssh command, run for real, to a host named so.
def probe_hostfile_hosts(run_dir: Path, host: str) -> None:
    hosts = HostfileHosts(run_dir, run_dir / "hostfile", {host: 1}, ssh_port=free_port())
    assert not hosts.answers(host, timeout=10)


def end_remote_ranks(run_dir: Path, host: str) -> None:
    RemoteRanks(ssh_options(port=free_port(), connect_timeout=5), [host], "launch-1").end()


def probe_cluster(run_dir: Path, host: str) -> None:
    (run_dir / "ssh_config").write_text("")
    # No workers and no backend: only the cluster's ssh is called.
    cluster = Cluster(
        run_dir, run_dir / "hostfile", run_dir / "known_hosts", run_dir / "ssh_config", None, 22, "", ("", 0), (), None
    )
    assert cluster.ssh(host, "true", timeout=10).returncode != 0


def check_before_launch(run_dir: Path, host: str) -> None:
    with pytest.raises(LaunchError):
        preflight([host], run_dir, ssh_port=free_port())


@pytest.mark.parametrize("reach", [probe_hostfile_hosts, end_remote_ranks, probe_cluster, check_before_launch])
def test_a_host_named_like_an_option_is_only_ever_a_host(tmp_path: Path, reach) -> None:
    """`--` ends ssh's options before the host in every ssh command the master builds: a host named
    ``-oProxyCommand=...`` runs nothing here (before, the hostfile hosts', the ranks' end and the cluster's ssh ran it)."""
    ran = tmp_path / "ran"
    reach(tmp_path, f"-oProxyCommand=touch {ran}")
    assert not ran.exists(), "ssh read the host as an option and ran its ProxyCommand on the master"
