"""Every refusal of bad input is one line naming the fix, before any worker or rank starts and before anything is
written: each bad input below goes through the real `textsql` command, in a process of its own (so every line it
prints is seen, log lines included), in an empty directory that must stay as it was."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import pytest
from helpers.launch import BIN, fake_prepared
from helpers.paths import PROJECT_DIR

from worker.network import free_port

# Where the bad inputs find the good parts they need (set up before the directory is looked at).
DATA = "prepared"
MODEL_RUN = "runs/my-model"
# A command that starts no rank ends within this; a store's endpoint is retried for a few seconds.
COMMAND_TIMEOUT_S = 120
# No store credentials, configuration or instance metadata of the machine's own: only what a case sets.
NO_STORE_SETTINGS = {
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_EC2_METADATA_DISABLED": "true",
}
KEYS = {"AWS_ACCESS_KEY_ID": "AKTEXTSQLTEST", "AWS_SECRET_ACCESS_KEY": "not-a-real-secret"}
NEEDS_S3FS = pytest.mark.skipif(find_spec("s3fs") is None, reason="s3fs absent: pip install 'textsql[store]'")


@dataclass(frozen=True)
class BadInput:
    """A command line a user may type, what its one line must say (the fix), and its exit status."""

    argv: tuple[str, ...]
    says: str
    exit_code: int = 1
    env: dict[str, str] = field(default_factory=dict)


def unreachable_endpoint() -> dict[str, str]:
    return KEYS | {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}


LAUNCH_WITH_STORE = ("launch", "--run-dir", "runs/x", "--checkpoint-store", "s3://nobucket/x", "--", "--data-dir", DATA)
CASES = {
    "store without credentials": (
        BadInput(LAUNCH_WITH_STORE, "(NoCredentialsError): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
        NEEDS_S3FS,
    ),
    "store with half the credentials": (
        BadInput(
            LAUNCH_WITH_STORE,
            "(PartialCredentialsError): set AWS_SECRET_ACCESS_KEY too",
            env={"AWS_ACCESS_KEY_ID": "AKTEXTSQLTEST"},
        ),
        NEEDS_S3FS,
    ),
    "store endpoint that nothing answers": (
        BadInput(LAUNCH_WITH_STORE, "(EndpointConnectionError): check AWS_ENDPOINT_URL", env=unreachable_endpoint()),
        NEEDS_S3FS,
    ),
    "store endpoint that is not a URL": (
        BadInput(
            LAUNCH_WITH_STORE,
            "AWS_ENDPOINT_URL '127.0.0.1:9000' is not a URL: write it as http://HOST:PORT",
            env=KEYS | {"AWS_ENDPOINT_URL": "127.0.0.1:9000"},
        ),
        NEEDS_S3FS,
    ),
    "infer from a missing data directory": (
        BadInput(
            ("infer", "--run-dir", MODEL_RUN, "--data-dir", "runs/nope"),
            "no prepared dataset at 'runs/nope' (no such directory); run `textsql prepare --data-dir DIR` first",
        ),
    ),
    "infer with a missing run directory": (
        BadInput(("infer", "--run-dir", "runs/nope"), "no run directory 'runs/nope'; pass --run-dir"),
    ),
    "train on a missing data directory": (
        BadInput(
            ("train", "--data-dir", "runs/nope", "--run-dir", "runs/x"),
            "no prepared dataset at 'runs/nope' (no such directory); run notebook 01 or `textsql prepare",
        ),
    ),
    "demo with an unknown profile": (
        BadInput(("demo", "-p", "profile=nope"), "unknown profile 'nope'; pass -p profile= one of auto, zero0, zero1"),
    ),
    "cleanup where no Slurm is configured": (
        BadInput(("workers", "cleanup", "--backend", "slurm"), "run on a Slurm login node"),
    ),
    "cleanup with SLURM_CONF naming no file": (
        BadInput(
            ("workers", "cleanup", "--backend", "slurm"),
            "SLURM_CONF names /nonexistent/slurm.conf, which does not exist; set it to the cluster's slurm.conf",
            env={"SLURM_CONF": "/nonexistent/slurm.conf"},
        ),
    ),
}


def everything_under(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*"))


def the_good_parts(directory: Path) -> None:
    """A prepared dataset (as a launch's check reads it) and a run whose model/ is a config-only T5."""
    fake_prepared(directory / DATA)
    shutil.copytree(PROJECT_DIR / "textsql" / "assets" / "t5-tiny", directory / MODEL_RUN / "model")


@pytest.mark.slow
@pytest.mark.timeout(COMMAND_TIMEOUT_S + 60)
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=case[1:], id=name.replace(" ", "-")) for name, case in CASES.items()]
)
def test_a_bad_input_is_one_line_naming_the_fix_and_writes_nothing(name: str, tmp_path: Path) -> None:
    bad = CASES[name][0]
    the_good_parts(tmp_path)
    before = everything_under(tmp_path)
    inherited = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "SLURM_", "TEXTSQL_"))}
    result = subprocess.run(
        [str(BIN / "textsql"), *bad.argv],
        cwd=tmp_path,
        env=inherited | NO_STORE_SETTINGS | {"OMP_NUM_THREADS": "1"} | bad.env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1, "\n".join(lines[-40:])
    assert lines[0].startswith("Error: ") and bad.says in lines[0], lines[0]
    assert result.returncode == bad.exit_code, lines[0]
    assert everything_under(tmp_path) == before, "the refusal wrote nothing"


# What a refusal may import before it speaks: the training parser needs torch and transformers (HfArgumentParser
# over Seq2SeqTrainingArguments), nothing else a rank or a model needs. Measured on 2 cores: `textsql infer` refused
# a missing run directory in 4.6 s before it checked before importing, `textsql train` a missing dataset in 5.6 s.
QUICK_REFUSALS = {
    "infer with a missing run directory": set(),
    "infer from a missing data directory": set(),
    "train on a missing data directory": {"torch", "transformers"},
}
HEAVY = ("torch", "transformers", "datasets", "deepspeed", "mlflow")


@pytest.mark.parametrize("name", [pytest.param(name, id=name.replace(" ", "-")) for name in QUICK_REFUSALS])
def test_a_refusal_imports_only_what_its_check_needs(name: str, tmp_path: Path) -> None:
    """In a fresh interpreter, the command refused as above, and which of the heavy modules it imported."""
    the_good_parts(tmp_path)
    script = (
        "import sys\nfrom textsql.cli import cli\n"
        f"try:\n    cli({list(CASES[name][0].argv)!r}, prog_name='textsql')\nexcept SystemExit as exit:\n    code = exit.code\n"
        f"print('imported:', sorted(set({HEAVY!r}) & set(sys.modules)), 'exit:', code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert CASES[name][0].says in result.stderr, result.stderr
    assert result.stdout.endswith(f"imported: {sorted(QUICK_REFUSALS[name])} exit: 1\n"), result.stdout
