"""Launch settings cannot become shell on the workers: real pdsh launches on two real local worker pods.

DeepSpeed's pdsh runner builds one remote shell command from ``.deepspeed_env`` (each value in double
quotes) and ``--master_addr``; each payload below would run ``touch MARKER`` on every host if it got
there. The rank program is the standard library's ``this`` (prints and exits), so a launch that does
run costs seconds, not a training.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from textsql.errors import LaunchError
from textsql.launching.command import LaunchArguments
from textsql.launching.launch import launch

pytestmark = pytest.mark.slow


def payloads(marker: Path) -> dict[str, tuple[dict, str]]:
    """name -> (LaunchArguments fields, the refusal's message)."""
    return {
        "env $(...)": ({"env": {"X": f"$(touch {marker})"}}, "has a $ that is not a plain $NAME"),
        "env ${...:-$(...)}": ({"env": {"X": f"${{Y:-$(touch {marker})}}"}}, "has a $ that is not a plain $NAME"),
        "socket_ifname quote": ({"socket_ifname": f'lo"; touch {marker}; "'}, "is not a network interface name"),
        "socket_ifname newline": (
            {"socket_ifname": f"lo\nLD_PRELOAD={marker}"},
            "is not a network interface name",
        ),
        "master_addr": ({"master_addr": f"127.0.0.2;touch {marker};"}, "is not an IP address or hostname"),
    }


def test_no_launch_setting_runs_on_the_workers_shell(two_local_workers, tmp_path):
    run_dir, ssh_config = two_local_workers.run_dir, two_local_workers.ssh_config
    ran, refused = {}, {}
    marker = tmp_path / "marker"
    for name, (fields, message) in payloads(marker).items():
        marker.unlink(missing_ok=True)
        try:
            code = launch(
                LaunchArguments(run_dir=run_dir, module="this", ssh_config=ssh_config, **fields), stream=io.StringIO()
            )
            refused[name] = f"launched (exit {code})"
        except LaunchError as error:
            refused[name] = str(error)
            assert message in str(error) and "\n" not in str(error), error
        deepspeed_env = run_dir / ".deepspeed_env"
        ran[name] = marker.exists() or (deepspeed_env.exists() and "LD_PRELOAD" in deepspeed_env.read_text())
    assert not any(ran.values()), {name: refused[name] for name, did in ran.items() if did}
    # The same launch with plain settings runs: the refusals above are the checks, not a broken launch.
    plain = LaunchArguments(
        run_dir=run_dir, ssh_config=ssh_config, module="this", socket_ifname="lo", env={"X": "$HOME/x"}
    )
    assert launch(plain, stream=io.StringIO()) == 0
