"""``bench/device.sh`` rehearsed on this CPU machine as a lent GPU machine would run it: offline, in a Python that
holds only the machine's own packages (torch and what it brings, numpy, pandas, pyarrow) and the carried wheels."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.bench import add_site
from helpers.distributions import bounded_beyond_torch, needs, pins
from packaging.utils import canonicalize_name

from bench.gpu_quick import RESULT_NAME
from textsql.constants import PROJECT_DIR

DEVICE_SCRIPT = PROJECT_DIR / "bench" / "device.sh"
WHEELS = PROJECT_DIR / "bench" / "wheels"
# What a GPU image holds beside its torch, which bench/wheels does not carry (device.sh refuses a machine without).
MACHINE_ROOTS = ("torch", "numpy", "pandas", "pyarrow")


def carried_names() -> set[str]:
    """The distributions bench/wheels holds, by canonical name."""
    return {canonicalize_name(path.name.split("-")[0]) for path in WHEELS.iterdir()}


def machine_site(root: Path) -> Path:
    """A directory holding links to the machine's packages as installed here. Of what torch brings and the wheels
    also carry, only the code is linked, not its ``.dist-info``: pip cannot count on an image's copy (it may be
    older than a carried package needs), so it must find one among the carried wheels."""
    site = root / "machine-site"
    site.mkdir()
    carried = carried_names()
    for name in sorted(needs(MACHINE_ROOTS)):
        distribution = importlib.metadata.distribution(name)
        for top in sorted({Path(str(file)).parts[0] for file in distribution.files or []}):
            if top == ".." or (site / top).exists() or (top.endswith(".dist-info") and name in carried):
                continue
            (site / top).symlink_to(Path(str(distribution.locate_file(top))))
    return site


def machine_python(root: Path) -> Path:
    """A fresh virtual environment whose only packages are the machine's (:func:`machine_site`), through a .pth."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # ensurepip's own setuptools (too old to build a wheel alone) would shadow the one torch brings, which a GPU
    # image holds and DeepSpeed's sdist is built with (--no-build-isolation).
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=False, timeout=300)
    add_site(python, machine_site(root), "machine")
    return python


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


def dry_run(python: Path, wheels: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(DEVICE_SCRIPT), "--dry-run", str(out)],
        check=False,
        cwd=PROJECT_DIR,
        env={**os.environ, "PYTHON": str(python), "WHEELS": str(wheels), "PIP_CONFIG_FILE": os.devnull},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def wheels() -> Path:
    """bench/wheels as `make gpu-wheels` builds it (downloads under 64 MiB the first time)."""
    if not pypi_reachable():
        pytest.skip("pypi.org is not reachable: `make gpu-wheels` cannot download the wheels to rehearse with")
    venv = Path(sys.executable).parent.parent
    made = subprocess.run(
        ["make", "-o", "setup", "gpu-wheels", f"VENV={venv}"],
        check=False,
        cwd=PROJECT_DIR,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-4000:]
    return WHEELS


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_carried_wheels_requirements_resolve_offline_beside_the_machines_torch(wheels, tmp_path):
    """device.sh's own pip call (``--no-index``, the carried folder only, DeepSpeed's sdist built against the
    machine's torch) resolves every requirement of every carried wheel; without typing-extensions it cannot."""
    python = machine_python(tmp_path)
    ran = dry_run(python, wheels, tmp_path / "out")
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    (would,) = [line for line in ran.stdout.splitlines() if line.startswith("Would install")]
    installed = {canonicalize_name(word.rpartition("-")[0]) for word in would.split()[2:]}
    assert {"deepspeed", "transformers", "datasets", "pydantic", "typing-extensions"} <= installed, would
    assert not installed & {"torch", "numpy", "pandas", "pyarrow"}, would  # the machine's own stay

    without = tmp_path / "without-typing-extensions"
    without.mkdir()
    for path in wheels.iterdir():
        if not path.name.startswith("typing_extensions-"):
            (without / path.name).symlink_to(path)
    refused = dry_run(python, without, tmp_path / "out-without")
    assert refused.returncode != 0 and "typing-extensions" in (refused.stdout + refused.stderr).lower().replace(
        "_", "-"
    )


def device_sh(*args: str, wheels: Path, budget_s: int | None = None) -> subprocess.CompletedProcess:
    """``bash bench/device.sh ARGS`` with ``BUDGET_S`` when given, else the script's own default."""
    env = {key: value for key, value in os.environ.items() if key != "BUDGET_S"}
    return subprocess.run(
        ["bash", str(DEVICE_SCRIPT), *args],
        check=False,
        cwd=PROJECT_DIR,
        env={
            **env,
            "PYTHON": sys.executable,
            "WHEELS": str(wheels),
            **({"BUDGET_S": str(budget_s)} if budget_s else {}),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )


def wrote_its_log(name: str, ran: subprocess.CompletedProcess, out: Path) -> None:
    """Fail naming the fixture ``name`` unless device.sh got as far as its own log in ``out``."""
    if not (out / "device.log").is_file():
        pytest.fail(f"{name}: device.sh wrote no {out / 'device.log'}: {(ran.stdout + ran.stderr)[-2000:]}")


# Each device.sh run starts a Python that imports torch (5-15 s here); the tests below read these two.
@pytest.fixture(scope="module")
def refused_without_wheels(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``bash bench/device.sh OUT`` run once with an empty wheels folder and a 300 s budget: the run and its OUT."""
    root = tmp_path_factory.mktemp("refused")
    (root / "wheels").mkdir()
    ran = device_sh(str(root / "out"), wheels=root / "wheels", budget_s=300)
    wrote_its_log("refused_without_wheels", ran, root / "out")
    return ran, root / "out"


@pytest.fixture(scope="module")
def dry_run_with_every_pin(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``bash bench/device.sh --dry-run OUT`` run once at the script's default budget (540 s: one call of 9 minutes),
    offered only an empty file for the pinned DeepSpeed sdist: deepspeed is installed here at the pin, so pip never
    opens it. The run and its OUT."""
    root = tmp_path_factory.mktemp("dry-run")
    wheels = root / "wheels"
    wheels.mkdir()
    pin = pins(PROJECT_DIR / "bench" / "gpu-requirements.txt")["deepspeed"]
    (wheels / f"deepspeed-{pin}.tar.gz").write_bytes(b"")
    ran = device_sh("--dry-run", str(root / "out"), wheels=wheels)
    wrote_its_log("dry_run_with_every_pin", ran, root / "out")
    return ran, root / "out"


def test_device_script_prints_its_time_against_its_budget_however_it_ends(
    refused_without_wheels, dry_run_with_every_pin
):
    refused, _ = refused_without_wheels
    assert refused.returncode == 2 and re.search(
        r"^device.sh: \d+ s of the 300 s budget$", refused.stdout, re.MULTILINE
    )
    checked, out = dry_run_with_every_pin
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert re.search(r"^device.sh: \d+ s of the 540 s budget$", checked.stdout, re.MULTILINE)
    assert "of the 540 s budget" in (out / "device.log").read_text()


def test_gpu_quick_keeps_the_ranks_logs_and_says_the_budget_spent_when_an_arm_fails(tmp_path, monkeypatch, capsys):
    from bench import __main__ as bench_main
    from bench import gpu_quick, quick_arms

    def failing_run(data_dir, work, sizes, device, save, budget):
        save({"arms": {"old_recipe": {}}})
        (work / "gpu-quick-defaults").mkdir()
        (work / "gpu-quick-defaults" / "bench.log").write_text(
            "x" * gpu_quick.LOG_TAIL_BYTES + "InductorError: no cc\n"
        )
        (work / "gpu-quick-defaults" / "launch.log").write_text("rank 0 exited with 1\n")
        raise RuntimeError("defaults failed with exit code 1; see bench.log")

    monkeypatch.setattr(bench_main, "prepare_data", lambda work, form: str(work / "data"))
    monkeypatch.setattr(gpu_quick, "run", failing_run)
    budget = gpu_quick.Budget(seconds=460, began=time.time() - 100)
    with pytest.raises(RuntimeError, match="defaults failed"):
        bench_main.measure_gpu_quick(quick_arms.SMOKE, "cpu", tmp_path / "out", None, budget)
    logs = tmp_path / "out" / gpu_quick.LOGS / "gpu-quick-defaults"
    assert (logs / "launch.log").read_text() == "rank 0 exited with 1\n"
    kept = (logs / "bench.log").read_text()
    assert len(kept) == gpu_quick.LOG_TAIL_BYTES and kept.endswith("InductorError: no cc\n")  # the end comes back
    printed = capsys.readouterr().out
    assert re.search(r"^gpu-quick: arm old_recipe done; 10\d s of the 460 s budget$", printed, re.MULTILINE), printed
    assert "kept 2 logs" in printed


def test_the_wheels_for_a_gpu_machine_are_what_the_pins_need_less_torch_and_the_machine_s_own():
    """bench/gpu-requirements.txt pins what requirements.txt pins; bench/gpu-wheels.txt adds everything those need, at
    the installed versions, less torch's own and the machine's numpy, pandas and pyarrow (not carried), but with what
    torch brings that a carried package needs newer (or older) than torch does: typing-extensions above all."""
    roots = pins(PROJECT_DIR / "bench" / "gpu-requirements.txt")
    assert roots.items() <= pins(PROJECT_DIR / "requirements.txt").items()
    machine = needs(["torch"]).keys() | needs(["numpy", "pandas", "pyarrow"]).keys()
    carried = {name: version for name, version in needs(roots).items() if name not in machine}
    bounded = bounded_beyond_torch(set(carried))
    assert "typing-extensions" in bounded  # pydantic and anyio need >= 4.16, torch >= 4.10
    wanted = carried | {name: importlib.metadata.version(name) for name in bounded}
    listed = pins(PROJECT_DIR / "bench" / "gpu-wheels.txt")
    assert "-r gpu-requirements.txt" in (PROJECT_DIR / "bench" / "gpu-wheels.txt").read_text()
    assert {**roots, **listed} == wanted


def test_device_script_parses_and_refuses_without_wheels(refused_without_wheels):
    assert subprocess.run(["bash", "-n", str(DEVICE_SCRIPT)], check=False).returncode == 0
    refused, out = refused_without_wheels
    assert refused.returncode == 2 and "make gpu-wheels" in refused.stdout + refused.stderr
    assert "torch" in refused.stdout  # it says what the machine has before anything else
    assert not (out / RESULT_NAME).exists()


def test_device_script_dry_run_installs_nothing_where_everything_is_present(dry_run_with_every_pin):
    """This environment holds every pin: pip, offered only the carried folder, has nothing to install."""
    ran, out = dry_run_with_every_pin
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "nothing to install" in ran.stdout and not re.search(r"^Would install", ran.stdout, re.MULTILINE)
    assert (out / "device.log").is_file() and not (out / RESULT_NAME).exists()


def test_a_budget_says_what_is_spent_of_it():
    from bench.gpu_quick import Budget

    assert Budget(460, began=1000.0).spent(now=1123.4) == "123 s of the 460 s budget"
    assert Budget(None, began=1000.0).spent(now=1010.0) == "10 s"


def new_repository(directory: Path) -> Callable[..., str]:
    """An empty git repository in ``directory`` that can commit, and a function running git there (its stdout)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=directory, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "bench@example.com")
    git("config", "user.name", "bench")
    return git


def test_a_copied_trees_claimed_commit_holds_only_where_its_files_hash_to_that_commits_tree(tmp_path, monkeypatch):
    """A GPU machine's copy of the tree may carry a stale .git: ``BENCH_COMMIT`` names the commit and its tree, and
    the figures count as committed only where the files as they are hash to that tree, whatever the copy's HEAD."""
    import bench.machine

    git = new_repository(tmp_path)
    (tmp_path / ".gitignore").write_text("wheels/\n")
    (tmp_path / "code.py").write_text("A = 1\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    first = git("rev-parse", "HEAD")
    (tmp_path / "code.py").write_text("A = 2\n")
    git("commit", "-qam", "second")
    claim = f"{git('rev-parse', '--short', 'HEAD')}:{git('rev-parse', 'HEAD^{tree}')}"
    git("reset", "-q", "--soft", first)  # the copy's .git is stale: its HEAD is the first commit
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "carried.whl").write_text("ignored, as the carried wheels are")
    monkeypatch.setattr(bench.machine, "PROJECT_DIR", tmp_path)
    monkeypatch.setenv(bench.machine.COMMIT_VARIABLE, claim)
    assert bench.machine.releases()["commit"] == claim.split(":")[0]
    assert bench.machine.releases()["uncommitted_changes"] is False
    assert git("rev-parse", "HEAD") == first, "the copy's own .git is left as it was"

    (tmp_path / "code.py").write_text("A = 3\n")
    assert bench.machine.releases()["uncommitted_changes"] is True
    (tmp_path / "code.py").write_text("A = 2\n")
    (tmp_path / "untracked.py").write_text("B = 1\n")
    assert bench.machine.releases()["uncommitted_changes"] is True, "a file the commit lacks is a change too"
    monkeypatch.setenv(bench.machine.COMMIT_VARIABLE, claim.split(":")[0])
    assert bench.machine.releases()["uncommitted_changes"] is True, "a commit without its tree proves nothing"


def test_a_figure_rewritten_after_each_arm_in_a_clean_checkout_still_names_its_commit_as_clean(tmp_path, monkeypatch):
    """A figure writes its JSON after each arm, into the checkout by default: its own earlier version is not a change
    to the code that measured it, but any other change still is."""
    import bench.machine

    git = new_repository(tmp_path)
    (tmp_path / "bench").mkdir()
    figure, code = tmp_path / "bench" / "figure.json", tmp_path / "bench" / "code.py"
    figure.write_text("{}\n")
    code.write_text("A = 1\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    monkeypatch.setattr(bench.machine, "PROJECT_DIR", tmp_path)
    monkeypatch.delenv(bench.machine.COMMIT_VARIABLE, raising=False)
    bench.machine.write_figure(figure, {"arms": {"first": 1}})
    bench.machine.write_figure(figure, {"arms": {"first": 1, "second": 2}})
    assert json.loads(figure.read_text())["releases"]["uncommitted_changes"] is False
    assert bench.machine.releases()["uncommitted_changes"] is True, "another figure's view of the checkout"
    code.write_text("A = 2\n")
    bench.machine.write_figure(figure, {"arms": {}})
    assert json.loads(figure.read_text())["releases"]["uncommitted_changes"] is True
