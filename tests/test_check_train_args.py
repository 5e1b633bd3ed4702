"""What the launching machine checks of a training command line before any rank starts (``check_train_args``):
the refusals a rank would give, in one line, and what it leaves to the ranks (``--profile auto``) at no import cost."""

import json
import shutil
import subprocess
import sys

import pytest
from helpers.launch import fake_prepared

from textsql.arguments import train_argv
from textsql.constants import ASSETS_DIR, DSCONFIG_DIR_VAR
from textsql.errors import DataError, LaunchError, ModelError, ProfileError
from textsql.planning.profiles import DSCONFIG_DIR
from textsql.planning.train_args import check_train_args, parse_command_line

T5_BASE_DIR = ASSETS_DIR / "t5-base"


@pytest.mark.parametrize(
    ("values", "error", "fix"),
    [
        ({"profile": "zero9"}, ProfileError, "unknown profile 'zero9'; pass --profile one of auto, zero0, zero1"),
        ({"model": "./no-such-model"}, ModelError, "model directory './no-such-model' does not exist; check --model"),
        ({"data_dir": "missing"}, DataError, "no such directory); run notebook 01 or `textsql prepare --data-dir DIR`"),
        ({"data_dir": "."}, DataError, "not a prepared dataset (no readable dataset_dict.json); run notebook 01"),
        ({"max_stepz": "3"}, LaunchError, "did you mean max_steps?"),
    ],
)
def test_check_train_args_refuses_in_one_line_what_the_ranks_would(tmp_path, monkeypatch, values, error, fix):
    monkeypatch.chdir(tmp_path)
    fake_prepared(tmp_path / "data")
    with pytest.raises(error) as raised:
        check_train_args(train_argv(**({"data_dir": "data", "run_dir": "out"} | values)))
    assert fix in str(raised.value) and "\n" not in str(raised.value)


def test_check_train_args_accepts_a_complete_run(tmp_path):
    check_train_args(
        train_argv(
            data_dir=fake_prepared(tmp_path / "data"),
            run_dir=tmp_path / "out",
            profile="zero3",
            overlay=["flops_profiler"],
        )
    )
    assert not (tmp_path / "out").exists(), "checking writes nothing"


def test_the_launching_machine_leaves_profile_auto_to_the_ranks_and_checks_every_profile_it_may_pick(
    tmp_path, monkeypatch
):
    """The estimate behind auto depends on the ranks' world and device, which the launching machine may not share:
    a master with 0.1 GiB of memory (no profile would fit t5-base there) accepts it, builds no model and imports no
    DeepSpeed; a rank parsing the same line resolves it."""
    monkeypatch.setattr("textsql.planning.estimate.os.sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else 26215)
    argv = train_argv(data_dir=fake_prepared(tmp_path / "data"), run_dir=tmp_path / "out", model=str(T5_BASE_DIR))
    _, _, run_args, training = check_train_args(argv)
    assert (run_args.profile, run_args.auto_profile, training["deepspeed"]) == ("auto", True, None)
    with pytest.raises(ProfileError, match="profile auto: no profile fits"):
        parse_command_line(argv)
    broken = tmp_path / "dsconfig"
    shutil.copytree(DSCONFIG_DIR, broken)
    config = json.loads((broken / "zero2.json").read_text())
    (broken / "zero2.json").write_text(json.dumps(config | {"bf16": {"enabled": True}}))
    monkeypatch.setenv(DSCONFIG_DIR_VAR, str(broken))
    with pytest.raises(ProfileError, match="profile 'zero2' fixes bf16.enabled to true but the run uses fp32"):
        check_train_args(argv)


def test_checking_a_launch_imports_no_deepspeed_and_builds_no_model(tmp_path):
    """In a fresh interpreter, as `textsql launch` starts: the training arguments and the checkpoint's size (the
    cluster check's) are read before any rank starts, without DeepSpeed or T5's modelling code (2-4 s)."""
    probe = (
        "import sys\n"
        "from textsql.arguments import train_argv\n"
        "from textsql.planning.train_args import check_train_args\n"
        "from textsql.launching.cluster_check import checkpoint_size\n"
        f"check_train_args(train_argv(data_dir={str(fake_prepared(tmp_path / 'data'))!r}, run_dir='out'))\n"
        "assert checkpoint_size(None) > 0\n"
        "loaded = {'deepspeed', 'transformers.models.t5.modeling_t5'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
