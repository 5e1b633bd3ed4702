"""The notebooks: committed clean and thin, and each one really runs headless under papermill.

The slow test reads the session's `make demo` (tests/conftest.py's ``docs_demo``: all three through `textsql demo`,
two `local` worker pods with their own sshd); another one checks that a failure inside the training cell still
releases the workers.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import papermill
import psutil
import pytest
from click.testing import CliRunner
from helpers.launch import fake_prepared
from helpers.notebooks import output_lines
from ipykernel.ipkernel import IPythonKernel

from textsql.cli import cli
from textsql.display.tensorboard import read_scalars
from textsql.errors import DataError, ModelError
from textsql.pipeline.demo import DEMO_MARKER, demo_data_dir, run_demo
from textsql.pipeline.manifest import INFER, TRAIN
from textsql.pipeline.parameters import (
    NOTEBOOKS,
    NotebookError,
    declared_defaults,
    declared_parameters,
    notebook_path,
    parse_overrides,
)
from textsql.pipeline.runs import run_notebook
from textsql.rank_lines import STEP_LINE

TEXTSQL = str(Path(sys.executable).parent / "textsql")
# The demo's held-out synthetic questions (docs/getting-started.md), all answered by notebook 03's default limit.
HELD_OUT_QUESTIONS = 1000
# What `textsql demo` prints where its output is no terminal, instead of a bar: a stage's time and latest step.
PLAIN_PROGRESS = re.compile(r"^\[\d+/\d+\] \w+: \d+ s( step \d+/\d+: .*)?$")
# Code cells call the package in a few statements; only the imports and the parameters may be longer.
MAX_CELL_STATEMENTS = 5
# ruff formats the cells to this width; the parameters cells, which it leaves as they are, must keep to it too.
MAX_LINE_LENGTH = 120


def code_cells(name: str) -> list:
    return [cell for cell in nbformat.read(notebook_path(name), as_version=4).cells if cell.cell_type == "code"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_clean_and_valid(name):
    notebook = nbformat.read(notebook_path(name), as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata.kernelspec.name == "python3"
    for cell in code_cells(name):
        assert cell.outputs == [] and cell.execution_count is None, f"{name}: clear the outputs before committing"


def minor_version(language_info: dict) -> dict:
    """``language_info`` with Python's version cut to major.minor: the file is saved from one patch level
    (a kernel of another patch level still marks it unsaved), and any Python 3.11 runs the suite."""
    return {**language_info, "version": ".".join(str(language_info.get("version", "")).split(".")[:2])}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_jupyterlab_opens_them_unchanged(name):
    """JupyterLab marks a notebook unsaved on opening when the kernel's language_info differs from the
    file's (it writes the kernel's into the metadata), so the file carries what this kernel announces,
    in the form JupyterLab saves (nbformat's, sorted keys, indent 1, a final newline)."""
    text = notebook_path(name).read_text()
    notebook = nbformat.reads(text, as_version=4)
    assert minor_version(notebook.metadata.get("language_info", {})) == minor_version(IPythonKernel.language_info), (
        f"{name}: open and save it in JupyterLab, or set metadata.language_info to {IPythonKernel.language_info}"
    )
    assert text == nbformat.writes(notebook) + "\n", f"{name}: save it with nbformat.write (or from JupyterLab)"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_first_code_cell_is_the_only_parameters_cell(name):
    cells = code_cells(name)
    tagged = [cell for cell in cells if "parameters" in cell.metadata.get("tags", [])]
    assert tagged == [cells[0]]
    assert papermill.inspect_notebook(str(notebook_path(name))), "papermill finds no parameters"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_cells_are_thin_calls_into_the_package(name):
    for cell in code_cells(name)[1:]:
        tree = ast.parse(cell.source)
        if all(isinstance(statement, (ast.Import, ast.ImportFrom)) for statement in tree.body):
            continue
        statements = [node for node in ast.walk(tree) if isinstance(node, ast.stmt)]
        assert len(statements) <= MAX_CELL_STATEMENTS, f"{name}: a cell is not thin:\n{cell.source}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_no_line_is_longer_than_the_code_s(name):
    notebook = nbformat.read(notebook_path(name), as_version=4)
    long = [line for cell in notebook.cells for line in cell.source.splitlines() if len(line) > MAX_LINE_LENGTH]
    assert long == [], f"{name}: lines past {MAX_LINE_LENGTH} characters"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_parameters_cell_keeps_its_aligned_help(name):
    """ruff formats every other cell; a parameters line it wrapped would lose its help to papermill."""
    (cell,) = [cell for cell in code_cells(name) if "parameters" in cell.metadata.get("tags", [])]
    assert cell.source.startswith("# fmt: off\n"), f"{name}: start the parameters cell with '# fmt: off'"
    assert all(spec["help"] for spec in declared_parameters(name).values()), f"{name}: a parameter has no help"


def test_run_all_learns_with_the_small_t5():
    """Notebook 01's defaults are the demo's: template questions, uncased, for the T5 from random weights;
    notebook 03 answers the sample's real questions beside them."""
    assert {k: declared_defaults("01_prepare_dataset")[k] for k in ("source", "input_format", "model")} == {
        "source": "synthetic",
        "input_format": "uncased",
        "model": "default",
    }
    assert declared_defaults("02_train_distributed")["model"] == "default"
    assert declared_defaults("03_inference")["real_source"] == "sample"


def test_training_runs_inside_the_workers_context():
    """The launch is in the body of `with start_workers(...)`, so the workers are released whatever happens."""
    tree = ast.parse("\n".join(cell.source for cell in code_cells("02_train_distributed")[1:]))
    blocks = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.With)
        and any(
            isinstance(item.context_expr, ast.Call) and getattr(item.context_expr.func, "id", "") == "start_workers"
            for item in node.items
        )
    ]
    assert len(blocks) == 1
    launches = [
        node
        for node in ast.walk(blocks[0])
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("launch", "supervise")
    ]
    assert launches, "launch() or supervise() must run inside the start_workers block"


def processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if text in " ".join(process.cmdline()) or any(text in value for value in process.environ().values()):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def test_unknown_notebook_and_foreign_directory_are_refused(tmp_path):
    with pytest.raises(NotebookError, match="unknown notebook 'train'; pass one of 01_prepare_dataset"):
        notebook_path("train")
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(NotebookError, match="is not a previous demo; pass another --run-dir"):
        run_demo(tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_a_new_demo_refuses_a_foreign_directory_where_its_dataset_goes(tmp_path):
    """The prepared dataset lies beside the run directory (the pods may write the run directory), so notebook 01
    would replace whatever is there: only a previous demo's dataset is."""
    beside = demo_data_dir(tmp_path / "demo")
    beside.mkdir()
    (beside / "precious.txt").write_text("keep me")
    with pytest.raises(NotebookError, match=r"demo-data' exists and is not a previous demo; pass another --run-dir"):
        run_demo(tmp_path / "demo")
    assert (beside / "precious.txt").read_text() == "keep me"


def test_demo_refuses_a_bad_profile_before_any_notebook_or_worker(tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(cli, ["demo", "--run-dir", str(out), "-p", "profile=zero9"])
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1 and result.output.startswith(
        "Error: unknown profile 'zero9'; pass -p profile= one of auto, zero0"
    )
    assert not out.exists(), "nothing was written, no notebook ran, no worker started"


@pytest.mark.parametrize("parameter", ["profile=zero9", "profil=zero1"])
def test_demo_refuses_a_bad_parameter_before_importing_torch(tmp_path, parameter):
    # A fresh interpreter, as `textsql demo` starts: the refusal must come before the heavy imports
    # (torch, transformers, datasets, papermill: 7.5 s of the 8 s a refusal took).
    script = (
        "import json, sys\n"
        "from textsql.cli import cli\n"
        f"try: cli(['demo', '--run-dir', {str(tmp_path / 'demo')!r}, '-p', {parameter!r}])\n"
        "except SystemExit as exit: code = exit.code\n"
        "heavy = ['torch', 'transformers', 'datasets', 'papermill', 'deepspeed']\n"
        "print(json.dumps([code, [name for name in heavy if name in sys.modules]]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    code, imported = json.loads(done.stdout.splitlines()[-1])
    assert code == 1 and done.stderr.startswith("Error: "), done.stderr
    assert imported == [], f"refusing {parameter} imported {imported}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_parameters_are_read_as_papermill_reads_them(name):
    assert declared_parameters(name) == papermill.inspect_notebook(str(notebook_path(name)))


def test_a_bad_model_or_data_dir_leaves_the_previous_demo_as_it_was(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    (out / DEMO_MARKER).touch()
    (out / "hostfile").write_text("127.0.0.2 slots=1\n")
    with pytest.raises(ModelError, match="no-such-model"):
        run_demo(out, {"02_train_distributed": {"model": str(tmp_path / "no-such-model")}})
    with pytest.raises(DataError, match="no prepared dataset at .*elsewhere.*run notebook 01"):
        run_demo(out, {"02_train_distributed": {"data_dir": str(tmp_path / "elsewhere")}})
    assert sorted(path.name for path in out.iterdir()) == [DEMO_MARKER, "hostfile"]


@pytest.mark.slow
def test_training_notebook_refuses_a_bad_profile_before_any_worker(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(NotebookError, match="02_train_distributed failed.*ProfileError: unknown profile 'zero9'"):
        run_notebook("02_train_distributed", tmp_path / "02.ipynb", {"run_dir": str(run_dir), "profile": "zero9"})
    assert not run_dir.exists(), "start_workers never ran: no token, no hostfile, no worker"


@pytest.mark.slow
def test_make_demo_runs_the_three_notebooks_end_to_end(docs_demo):
    """The README's `make demo`, run once a session as getting-started's block (tests/conftest.py's ``docs_demo``):
    its terminal, logs, TensorBoard scalars, notebooks and outputs."""
    out, stdout, stderr = docs_demo.run_dir, docs_demo.terminal.stdout, docs_demo.terminal.stderr
    max_steps, eval_steps = (docs_demo.parameter(TRAIN, name) for name in ("max_steps", "eval_steps"))
    evaluated = [*range(eval_steps, max_steps, eval_steps), max_steps]
    assert "MISSING" not in stdout and "textsql tensorboard --logdir" in stdout
    terminal = stdout + stderr
    said = [line for line in terminal.splitlines() if not PLAIN_PROGRESS.match(line)]
    assert len(said) < 60, "the demo is noisy again:\n" + "\n".join(said[-60:])
    assert "done in" in stderr and "[IPKernelApp]" not in terminal and "[INFO]" not in terminal
    assert "[INFO]" in (out / "launch.log").read_text() and "Executing Cell" in (out / "demo.log").read_text(), (
        "the logs keep it all"
    )

    assert (out / DEMO_MARKER).is_file()
    assert [line.split()[0] for line in (out / "hostfile").read_text().splitlines()] == ["127.0.0.2", "127.0.0.3"]
    assert "pdsh" in (out / "launch.log").read_text()
    scalars = read_scalars(out / "tensorboard")
    assert list(scalars) == ["demo"], "TensorBoard names the run after its directory"
    assert [step for step, _ in scalars["demo"]["eval/loss"]] == evaluated, (
        "eval/loss at each evaluation, the last once"
    )
    assert [step for step, _ in scalars["demo"]["eval/lf_accuracy"]] == evaluated
    assert (out / "model" / "config.json").is_file()
    predictions = (out / "predictions.jsonl").read_text().splitlines()
    answered = json.loads((out / "metrics.json").read_text())["n"]
    assert len(predictions) == answered == (docs_demo.parameter(INFER, "limit") or HELD_OUT_QUESTIONS)
    for name in NOTEBOOKS:
        executed = nbformat.read(out / "notebooks" / f"{name}.ipynb", as_version=4)
        assert all(cell.execution_count for cell in executed.cells if cell.cell_type == "code"), (
            f"{name} did not run every cell"
        )
    executed = {
        name: nbformat.read(out / "notebooks" / f"{name}.ipynb", as_version=4)
        for name in ("02_train_distributed", "03_inference")
    }
    plotted = [
        output
        for cell in executed["02_train_distributed"].cells
        for output in cell.get("outputs", [])
        if "image/png" in output.get("data", {})
    ]
    assert plotted, "notebook 02 drew no loss plot"
    recommended = [
        line
        for cell in executed["02_train_distributed"].cells
        for output in cell.get("outputs", [])
        for line in output.get("text", "").splitlines()
        if line.startswith("this run uses: ")
    ]
    # A step line every 10 steps was 234 lines for the demo's 2,000 steps: one bar instead, the lines in launch.log.
    shown = output_lines(executed["02_train_distributed"])
    losses = [line for line in shown if (step := STEP_LINE.match(line)) and step["text"].startswith("loss ")]
    assert len(shown) <= 100 and not losses, shown
    assert [line for line in shown if f"{max_steps}/{max_steps} steps" in line], (
        "notebook 02's bar, its text saying how it ended"
    )
    logged = (out / "launch.log").read_text()
    assert f"step 10/{max_steps}: loss " in logged
    assert re.search(rf"step {max_steps}/{max_steps}: loss \S+ \(\d+ s, 0 s left\)", logged)
    assert json.loads((out / "run.json").read_text())["progress"]["steady_from_step"] == eval_steps
    assert recommended == [
        f"this run uses: {json.loads((out / 'run.json').read_text())['profile']} (profile auto: the recommendation)"
    ]
    outputs = [output.get("data", {}) for cell in executed["03_inference"].cells for output in cell.get("outputs", [])]
    assert any("image/png" in data for data in outputs), "notebook 03 drew no accuracy plot"
    assert sum("gold_sql" in data.get("text/html", "") for data in outputs) == 2, (
        "predictions beside their gold SQL, and the worst ones"
    )
    assert not processes_mentioning(str(out)), "worker processes outlived the demo"


@pytest.mark.slow
def test_training_notebook_releases_workers_when_the_training_cell_fails(tmp_path):
    run_dir = tmp_path / "run"
    # The split list passes the check before the workers (what launch's plan reads of a prepared dataset), but there
    # are no splits: every rank fails inside the `with start_workers(...)` block, after both workers registered.
    data_dir = fake_prepared(tmp_path / "data")
    parameters = {"run_dir": str(run_dir), "data_dir": str(data_dir), "max_restarts": 0}
    with pytest.raises(NotebookError, match="02_train_distributed failed.*LaunchError.*training failed with exit code"):
        run_notebook("02_train_distributed", tmp_path / "02.ipynb", parameters)
    assert len((run_dir / "hostfile").read_text().splitlines()) == 2, "the workers never registered"
    assert not processes_mentioning(str(run_dir)), "workers were left running after the failure"


def test_an_unknown_notebook_parameter_is_an_error_naming_the_known_ones(tmp_path):
    with pytest.raises(
        NotebookError, match=r"notebook 03_inference has no parameter 'profil'; its parameters are run_dir, data_dir"
    ):
        run_notebook("03_inference", tmp_path / "03.ipynb", {"profil": "zero1"})
    result = CliRunner().invoke(cli, ["demo", "--run-dir", str(tmp_path / "demo"), "-p", "profil=zero1"])
    assert result.exit_code == 1 and "sets no notebook parameter" in result.output and "profile" in result.output
    assert not (tmp_path / "demo").exists()


def test_a_renamed_parameter_names_its_new_name():
    with pytest.raises(NotebookError, match=r"'per_device_batch_size=4' .*did you mean per_device_train_batch_size\?"):
        parse_overrides(["per_device_batch_size=4"])


def test_cml_job_reports_a_failing_notebook_in_one_line(tmp_path):
    job = Path(__file__).resolve().parent.parent / "cml" / "run_notebook.py"
    env = {**os.environ, "TEXTSQL_PROFILE": "zero9"}
    result = subprocess.run(
        [sys.executable, str(job), "not_a_notebook"], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("Error: unknown notebook 'not_a_notebook'; pass one of 01_prepare_dataset")
    )
