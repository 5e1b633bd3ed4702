"""The agent's settings: where its address, pod name, token and slots come from, and bad values."""

from __future__ import annotations

import pytest

from textsql.errors import TextSQLError
from worker import constants as c
from worker.agent import AgentConfig
from worker.network import route_address
from worker.rendezvous.token import new_token


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    token_file = tmp_path / "token"
    new_token(token_file)
    return {
        c.ENV_RENDEZVOUS: "127.0.0.1:29400",
        c.ENV_TOKEN_FILE: str(token_file),
        c.ENV_CLIENT_PUBKEY: "ssh-ed25519 AAAA",
        c.ENV_SLOTS: "2",
    }


def test_explicit_address_beats_platform_variables(env):
    config = AgentConfig.from_env({**env, "CDSW_IP_ADDRESS": "10.0.0.8", c.ENV_ADDRESS: "127.0.0.5"})
    assert config.address == "127.0.0.5"


def test_cml_and_kubernetes_variables_give_address_and_pod(env):
    cml = AgentConfig.from_env({**env, "CDSW_IP_ADDRESS": "10.0.0.8", "CDSW_ENGINE_ID": "abc123", "HOSTNAME": "h"})
    assert (cml.address, cml.pod) == ("10.0.0.8", "abc123")
    pod = AgentConfig.from_env({**env, "POD_IP": "10.42.1.7", "HOSTNAME": "textsql-run-0"})
    assert (pod.address, pod.pod, pod.slots, pod.ssh_port) == ("10.42.1.7", "textsql-run-0", 2, 2222)


def test_without_hints_the_address_is_the_route_to_the_master(env):
    assert AgentConfig.from_env(env).address == route_address("127.0.0.1") == "127.0.0.1"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({c.ENV_RENDEZVOUS: ""}, "TEXTSQL_RENDEZVOUS is not set"),
        ({c.ENV_RENDEZVOUS: "nohost"}, "must be HOST:PORT"),
        ({c.ENV_TOKEN_FILE: ""}, "set TEXTSQL_RENDEZVOUS_TOKEN_FILE"),
        ({c.ENV_CLIENT_PUBKEY: ""}, "TEXTSQL_CLIENT_PUBKEY is not set"),
        ({c.ENV_SLOTS: "0"}, "slots 0 must be"),
        ({c.ENV_SSH_PORT: "x"}, "bad number"),
        ({c.ENV_ADDRESS: "0.0.0.0"}, "cannot be reached"),
    ],
)
def test_bad_settings_name_the_variable(env, changes, message):
    with pytest.raises(TextSQLError, match=message):
        AgentConfig.from_env({**env, **changes})


def test_register_only_needs_no_client_key(env):
    config = AgentConfig.from_env({**env, c.ENV_CLIENT_PUBKEY: "", c.ENV_SSHD: "0"})
    assert config.sshd is False


def test_missing_sshd_names_the_package():
    from worker.errors import WorkerError
    from worker.sshd import require_tool

    with pytest.raises(
        WorkerError, match=r"/no/such/sshd is not installed; install it with: apt-get install -y openssh-server"
    ):
        require_tool("/no/such/sshd")
