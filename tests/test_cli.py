"""The `textsql` command speaks one dialect: kebab-case options, --x/--no-x booleans, ranges equal to what the
code accepts, environment variables shown, commands in pipeline order, a short `train -h`."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from textsql.cli import cli
from textsql.cli.help import TRAIN_ESSENTIALS
from textsql.cli.main import COMMAND_ORDER
from textsql.cli.training import LAUNCH_SECTIONS
from textsql.errors import LaunchError
from textsql.launching.command import LaunchArguments
from textsql.launching.supervisor import Supervisor
from textsql.launching.training_plan import TrainingPlan
from worker.constants import MAX_EXPECTED_WORKERS, MAX_SLOTS
from worker.errors import RendezvousError
from worker.registration import check_slots
from worker.rendezvous.server import RendezvousServer

HOSTS = ("127.0.0.2", "127.0.0.3")


def commands(group: click.Group = cli, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    """Every command under ``group`` with the words that name it."""
    found = []
    for name, command in group.commands.items():
        found.append(((*path, name), command))
        if isinstance(command, click.Group):
            found += commands(command, (*path, name))
    return found


def typed_options(command: click.Command) -> list[click.Option]:
    return [param for param in command.params if isinstance(param, click.Option) and not param.is_eager]


def section(text: str, title: str) -> str:
    """The lines under ``title:`` of a help page, up to the next blank line."""
    return text.split(f"\n{title}:\n", 1)[1].split("\n\n", 1)[0]


def test_version_is_the_installed_packages():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"textsql, version {importlib.metadata.version('textsql')}\n"


def test_commands_are_listed_in_pipeline_order():
    listed = [line.split()[0] for line in section(CliRunner().invoke(cli, ["--help"]).output, "Commands").splitlines()]
    assert listed == list(COMMAND_ORDER)
    assert sorted(listed) == sorted(cli.commands), "every command is listed once"
    served = section(CliRunner().invoke(cli, ["rendezvous", "--help"]).output, "Commands")
    assert [line.split()[0] for line in served.splitlines()] == ["serve", "register"]


def test_every_option_is_kebab_case_and_every_boolean_a_flag_pair():
    for path, command in commands():
        for option in typed_options(command):
            for flag in option.opts + option.secondary_opts:
                assert flag == flag.lower() and "_" not in flag, (path, flag)
            if option.is_bool_flag:
                assert option.secondary_opts == [f"--no-{option.opts[-1][2:]}"], (path, option.opts)
            else:
                assert not isinstance(option.type, click.types.BoolParamType), f"{path} {option.opts}: a BOOLEAN value"


def test_help_names_the_environment_variable_of_every_option():
    for path, command in commands():
        if command.name == "train":
            continue
        prefix = "_".join(("TEXTSQL", *path)).upper()
        page = CliRunner().invoke(cli, [*path, "--help"], terminal_width=400).output
        for option in typed_options(command):
            assert f"{prefix}_{option.name.upper()}]" in page.replace("; ", "]"), (path, option.opts)


def command_contexts(group: click.Group = cli, parent: click.Context | None = None) -> list[click.Context]:
    """A context for every command under ``group``, as click builds them when the command runs."""
    parent = parent or click.Context(cli, info_name="textsql", **cli.context_settings)
    found = []
    for name, command in group.commands.items():
        ctx = click.Context(command, info_name=name, parent=parent)
        found.append(ctx)
        if isinstance(command, click.Group):
            found += command_contexts(command, ctx)
    return found


def test_every_options_variable_is_textsql_command_option():
    """docs/reference/cli.md: every option can come from TEXTSQL_<COMMAND>_<OPTION>, named after its long flag."""
    for ctx in command_contexts():
        words = ctx.command_path.split()[1:]
        for option in typed_options(ctx.command):
            if option.hidden:
                continue
            flag = next(opt for opt in option.opts if opt.startswith("--"))
            expected = "_".join(("TEXTSQL", *words, flag[2:])).replace("-", "_").upper()
            assert option.get_help_extra(ctx)["envvars"] == (expected,), (ctx.command_path, flag)


def test_every_summary_fits_its_line():
    """`textsql --help` and the CLI reference page (mkdocs-click's command list) show each summary whole."""
    for ctx in command_contexts():
        assert ctx.command.short_help, f"{ctx.command_path}: no short_help, click would cut its docstring"
        assert ctx.command.get_short_help_str() == ctx.command.short_help, ctx.command_path
    for words in ([], ["rendezvous"], ["workers"]):
        listed = section(CliRunner().invoke(cli, [*words, "--help"]).output, "Commands")
        assert "..." not in listed, listed


@pytest.mark.parametrize(
    "words, environ, message",
    [
        (["demo", "--out", "d"], {}, "--out was renamed --run-dir: textsql demo --run-dir DIR"),
        (["prepare", "--out", "d"], {}, "--out was renamed --data-dir: textsql prepare --data-dir DIR"),
        (["infer", "--data", "d"], {}, "--data was renamed --data-dir: textsql infer --data-dir DIR"),
        (["evaluate", "--pred", "p"], {}, "--pred was renamed --predictions-file: textsql evaluate --predictions-file"),
        (["train", "--output-dir", "r"], {}, "--output-dir was renamed --run-dir: textsql train --run-dir DIR"),
        (["train", "--resume", "auto"], {}, "--resume was renamed --resume-from-checkpoint: textsql train"),
        (["demo"], {"TEXTSQL_DEMO_OUT": "d"}, "TEXTSQL_DEMO_OUT was renamed TEXTSQL_DEMO_RUN_DIR"),
        (["infer"], {"TEXTSQL_INFER_DATA": "d"}, "TEXTSQL_INFER_DATA was renamed TEXTSQL_INFER_DATA_DIR"),
        (["demo"], {"TEXTSQL_DEMO_PARAMETERS": "x=1"}, "TEXTSQL_DEMO_PARAMETERS was renamed TEXTSQL_DEMO_PARAMETER"),
        (
            ["estimate"],
            {"TEXTSQL_ESTIMATE_NAMES": "zero1"},
            "TEXTSQL_ESTIMATE_NAMES was renamed TEXTSQL_ESTIMATE_PROFILE",
        ),
        (["evaluate"], {"TEXTSQL_EVALUATE_AS_JSON": "1"}, "TEXTSQL_EVALUATE_AS_JSON was renamed TEXTSQL_EVALUATE_JSON"),
        (["workers", "cleanup"], {"TEXTSQL_WORKERS_CLEANUP_RUN_ID": "r"}, "was renamed TEXTSQL_WORKERS_CLEANUP_RUN"),
    ],
)
def test_the_previous_releases_names_are_refused_with_the_new_one(words, environ, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, words, env=environ)
    assert result.exit_code == 2 and message in result.output, result.output
    assert list(tmp_path.iterdir()) == [], "refused before anything ran"


def test_the_environment_variable_shown_is_the_one_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TEXTSQL_LAUNCH_STALL_TIMEOUT", "5")
    result = CliRunner().invoke(cli, ["launch", "--run-dir", "run"])
    assert result.exit_code == 2 and "'--stall-timeout': 5.0 is not in the range x>=20.0" in result.output


def launch_options(tmp_path: Path, *options: str) -> click.testing.Result:
    """`textsql launch` over two hosts that do not answer: every value the supervisor accepts ends at the
    launch's ssh check, so the exit says whether click and the supervisor let it through."""
    (tmp_path / "hostfile").write_text("".join(f"{host} slots=1\n" for host in HOSTS))
    return CliRunner().invoke(cli, ["launch", "--run-dir", str(tmp_path), "--module", "json.tool", *options])


def supervisor_accepts(tmp_path: Path, **values: float) -> bool:
    try:
        arguments = LaunchArguments(run_dir=tmp_path, module="json.tool")
        Supervisor(arguments, plan=TrainingPlan.read(arguments), **values)
    except LaunchError:
        return False
    return True


@pytest.mark.parametrize(
    "name, refused, accepted",
    [("stall_timeout", 19.9, 20), ("min_workers", 0, 1), ("replace_timeout", -0.5, 0), ("max_restarts", -1, 0)],
)
def test_launch_ranges_are_the_supervisors(tmp_path: Path, name: str, refused: float, accepted: float):
    flag = f"--{name.replace('_', '-')}"
    launch_options(tmp_path)  # the hostfile
    assert not supervisor_accepts(tmp_path, **{name: refused}) and supervisor_accepts(tmp_path, **{name: accepted})
    result = launch_options(tmp_path, flag, str(refused))
    assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output, result.output
    result = launch_options(tmp_path, flag, str(accepted))
    assert result.exit_code == 1 and "passwordless ssh failed for 127.0.0.2" in result.output, result.output


def refuse_slots(count: int) -> None:
    check_slots(count)


def refuse_expected(count: int) -> None:
    RendezvousServer(count, "t" * 32)


@pytest.mark.parametrize(
    "words, flag, bound, worker_check",
    [
        (
            ["rendezvous", "register", "--master", "127.0.0.1:1", "--token-file", "t", "--address", "a"],
            "--slots",
            MAX_SLOTS,
            refuse_slots,
        ),
        (
            ["rendezvous", "serve", "--token-file", "t", "--hostfile", "h"],
            "--expect",
            MAX_EXPECTED_WORKERS,
            refuse_expected,
        ),
    ],
)
def test_worker_counts_are_bounded_as_the_workers_check_them(words, flag, bound, worker_check):
    with pytest.raises(RendezvousError, match=f"{flag}$"):
        worker_check(bound + 1)
    for value in (0, bound + 1):
        result = CliRunner().invoke(cli, [*words, flag, str(value)])
        assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output, result.output


def test_min_workers_reaches_the_supervisor(tmp_path: Path):
    result = launch_options(tmp_path, "--min-workers", "3")
    assert result.exit_code == 1
    assert result.output == "Error: --min-workers 3 must be from 1 to the number of workers (2)\n"


def test_launch_help_lists_its_options_in_sections():
    page = CliRunner().invoke(cli, ["launch", "--help"], terminal_width=400).output
    titles = [line[:-1] for line in page.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == [*LAUNCH_SECTIONS, "Options"]
    for title, names in LAUNCH_SECTIONS.items():
        lines = section(page, title).splitlines()
        assert [line.split()[0] for line in lines] == [f"--{name.replace('_', '-')}" for name in names], title
    options = {option.name for option in typed_options(cli.commands["launch"])}
    assert options == {name for names in LAUNCH_SECTIONS.values() for name in names}
    recovery = section(page, "Recovery")
    assert "--min-workers" in recovery and "--replace-timeout" in recovery


def test_train_short_help_is_short_and_imports_no_torch():
    """`train -h` in a fresh interpreter: the page, and whether torch or transformers were imported for it."""
    script = (
        "import sys\nfrom textsql.cli import cli\n"
        "try:\n    cli(['train', '-h'], prog_name='textsql')\nexcept SystemExit as exit:\n    code = exit.code\n"
        "print('heavy:', sorted({'torch', 'transformers'} & set(sys.modules)), 'exit:', code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).parent,
    )
    assert result.stdout.endswith("heavy: [] exit: 0\n"), result.stdout + result.stderr
    assert result.stdout.count("\n") < 80
    assert "--help-all" in result.stdout and "kebab-case" in result.stdout
    for name, _ in TRAIN_ESSENTIALS:
        assert f"  --{name.replace('_', '-')} " in result.stdout, name


def test_the_short_help_names_only_real_training_flags_in_either_spelling():
    from textsql.planning.train_args import parse_command_line

    kebab = ["--data-dir", "data", "--run-dir", "out", "--per-device-train-batch-size", "4", "--no-constrained"]
    snake = ["--data_dir", "data", "--run_dir", "out", "--per_device_train_batch_size", "4", "--no_constrained"]
    assert parse_command_line(kebab) == parse_command_line(snake)
    *_, training = parse_command_line(kebab)
    assert training["per_device_train_batch_size"] == 4
    _, data, run, _ = parse_command_line([*kebab, "--overwrite-output-dir", "--no-overwrite-output-dir"])
    assert (data.constrained, run.overwrite_output_dir) == (False, False)
    values = {"data_dir": "data", "run_dir": "out", "model": "default", "profile": "zero1", "precision": "fp32"}
    values |= {"resume_from_checkpoint": "auto", "overwrite_output_dir": "false", "learning_rate": "0.01"}
    every = [word for name, _ in TRAIN_ESSENTIALS for word in (f"--{name.replace('_', '-')}", values.get(name, "2"))]
    *_, training = parse_command_line(every)  # an unknown flag raises LaunchError
    assert (training["max_steps"], training["learning_rate"]) == (2, 0.01)


def test_help_all_is_the_training_parsers_own_with_kebab_case_first():
    result = CliRunner().invoke(cli, ["train", "--help-all"], terminal_width=400)
    assert result.exit_code == 0
    assert "--per-device-train-batch-size PER_DEVICE_TRAIN_BATCH_SIZE, --per_device_train_batch_size" in result.output
    assert "kebab-case" in result.output and "--lr-scheduler-type" in result.output


@pytest.mark.parametrize(
    "words, fix",
    [
        (["--source", "sample"], "no model; pass --run-dir RUN (a `textsql train` run) or --model DIR"),
        (["--model", "default"], "nowhere to write; pass --run-dir RUN or --predictions-file FILE"),
        (["--run-dir", "run", "--source", "sample", "--data-dir", "."], "pass only one of --data-dir, --source"),
    ],
)
def test_infer_needs_a_model_and_a_place_to_write(words: list[str], fix: str, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["infer", *words, "--limit", "1"])
    assert result.exit_code == 2 and f"Error: {fix}" in result.output, result.output
    assert list(tmp_path.iterdir()) == [], "nothing written into the current directory"


@pytest.mark.parametrize(
    "words, gone",
    [
        (["prepare", "--model", "t5-small"], "--model"),
        (["infer", "--model", "default", "--out", "p.jsonl"], "--out"),
        (["infer", "--model", "default", "--official-out", "o.jsonl"], "--official-out"),
        (["evaluate", "--predictions-file", __file__, "--out", "r.json"], "--out"),
        (["infer", "--model", "default", "--constrained", "false"], "false"),
    ],
)
def test_old_spellings_are_refused(words: list[str], gone: str):
    result = CliRunner().invoke(cli, words)
    assert result.exit_code == 2 and gone in result.output, result.output


def test_prepare_names_the_tokenizer_flag(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(
        cli, ["prepare", "--data-dir", str(tmp_path / "out"), "--limit", "2", "--tokenizer", str(tmp_path / "empty")]
    )
    assert result.exit_code == 1 and "pass --tokenizer a directory that has them" in result.output, result.output


def test_notebook_02s_resume_parameter_is_resume_from_checkpoint():
    result = CliRunner().invoke(cli, ["preflight", "-p", "resume=auto"])
    assert result.exit_code == 1 and "(did you mean resume_from_checkpoint?)" in result.output, result.output
    result = CliRunner().invoke(cli, ["preflight"], env={"TEXTSQL_RESUME": "auto"})
    assert "Error: TEXTSQL_RESUME was renamed TEXTSQL_RESUME_FROM_CHECKPOINT: set that instead" in result.output
