"""Shared fixtures: the shared real data, local worker pods, a loopback sshd, a Slurm cluster, the CML emulator. Helpers that are
no fixtures live in tests/helpers/."""

import logging
import os
import signal
import sys
from pathlib import Path

import pytest
from helpers.markers import PROCESS_FIXTURES, unmarked_process_tests
from helpers.paths import FAKES, SHARED_DATA_DIR
from helpers.scheduling import GroupScheduling, misplaced_docs_readers, order_groups

# One torch thread in every process the tests start (set before any test imports torch; the ranks inherit it through
# the launch's allow-list): the suite's ranks, kernels and pytest-xdist workers share two cores, where torch's default
# of a thread per core gives each process spinning OpenMP threads that wait on the others' (a step 4x slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def master_state_dir(tmp_path_factory):
    """The runs' master-private directories (textsql.rundir.master_state.master_dir) under the session's temp dir, for this
    process and every one it starts, not in the user's ~/.local/state."""
    from textsql.rundir.master_state import STATE_DIR_VAR

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(STATE_DIR_VAR, str(tmp_path_factory.mktemp("state")))
        yield


@pytest.fixture(autouse=True)
def no_attempt_marker(monkeypatch):
    """No test's subprocess carries an attempt's marks from the environment the tests run in (a demo's kernel, a
    CML job): a continuation would take it for the run's."""
    from textsql.pipeline.manifest import ATTEMPT_VAR
    from textsql.rank_lines import RUN_MARK_VAR

    monkeypatch.delenv(ATTEMPT_VAR, raising=False)
    monkeypatch.delenv(RUN_MARK_VAR, raising=False)


@pytest.fixture(autouse=True)
def log_level_kept():
    """The run's log level is process-wide (textsql.console): an in-process `textsql --verbose` or a notebook call of
    ``set_log_level`` changes the environment and the libraries' loggers for every later test on its pytest-xdist
    worker (test_step_bar's quiet-lines test then showed a rank's INFO line after test_console's verbose case, in
    one order of the modules of two). Each test leaves them as it found them, after its own fixtures' undoing."""
    import logging

    from textsql.console import LOG_LEVEL_VAR, QUIET_ENVIRONMENT, QUIET_WARNINGS, THIRD_PARTY_LOGGERS

    environment = {name: os.environ.get(name) for name in (LOG_LEVEL_VAR, "PYTHONWARNINGS", *QUIET_ENVIRONMENT)}
    loggers = [logging.getLogger(name) for name in (*THIRD_PARTY_LOGGERS, *QUIET_WARNINGS)]
    kept = [(logger, logger.level, list(logger.filters)) for logger in loggers]
    yield
    for name, value in environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    for logger, level, filters in kept:
        logger.setLevel(level)
        logger.filters[:] = filters


@pytest.fixture
def slurm_cluster(monkeypatch):
    """A real two-node Slurm started for the test (tests/helpers/slurm.py), both nodes idle, its SLURM_CONF set for
    this process's Slurm commands; stopped and removed after it. Skips where slurm-wlm and munge are absent."""
    from helpers.slurm import missing_tools, new_cluster

    if missing_tools():
        pytest.skip(
            f"{', '.join(missing_tools())} absent: Debian's slurm-wlm and munge; run scripts/setup-system.sh --dev"
        )
    cluster = new_cluster()
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    try:
        yield cluster
    finally:
        print(cluster.errors() or "no error in the Slurm daemons' logs")  # shown with a failed test's report
        cluster.stop()


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """../shared/data beside the checkout (real WikiSQL files); tests needing it skip without it."""
    if not SHARED_DATA_DIR.is_dir():
        pytest.skip(f"{SHARED_DATA_DIR} is not present")
    return SHARED_DATA_DIR


@pytest.fixture
def wikisql_release_copy(tmp_path: Path) -> Path:
    """A writable copy of the shipped WikiSQL sample (release layout), for tests that corrupt it."""
    import shutil

    from textsql.constants import SAMPLE_DATA_DIR

    return Path(shutil.copytree(SAMPLE_DATA_DIR, tmp_path / "release"))


@pytest.fixture
def two_local_workers(tmp_path: Path):
    """Two `local` worker pods (own sshd on 127.0.0.2 and 127.0.0.3) registered through the
    rendezvous; the run dir tmp_path/"run" holds their hostfile, ssh_config and known_hosts."""
    from worker.cluster import start_workers

    with start_workers("local", 2, tmp_path / "run", timeout=120) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def train_data(tmp_path_factory) -> Path:
    """The shipped sample's train split alone (64 questions), so the recovery runs spend no time evaluating."""
    from bench.profiles import train_only
    from textsql.data.prepare import PrepareArguments, prepare

    work = tmp_path_factory.mktemp("recovery")
    prepare(PrepareArguments(data_dir=str(work / "data"), limit=64, max_source_length=96))
    return train_only(str(work / "data"), work)


@pytest.fixture(scope="session")
def prepared_sample(tmp_path_factory) -> Path:
    """The shipped WikiSQL sample prepared by `textsql prepare --limit 64` (64 questions a split)."""
    from textsql.data.prepare import PrepareArguments, prepare

    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare(PrepareArguments(data_dir=str(out), limit=64))
    return out


@pytest.fixture(scope="session")
def reader_project(tmp_path_factory) -> Path:
    """A copy of the checkout set up as a reader's (tests/helpers/doc_runs.py), where every page's blocks run at most
    once a session (tests/helpers/doc_blocks.py): the docs blocks' tests and the tests reading a block's run share it."""
    import importlib.util
    import subprocess

    from helpers.doc_runs import reader_checkout

    project = reader_checkout(tmp_path_factory.mktemp("reader"))
    # Its interpreter finds DeepSpeed at this one's own path: DeepSpeed compiles its CPU ops from the files' paths,
    # and a second path to the same files would rebuild the op cache both share, then the next rank here rebuild it.
    origin = "import importlib.util; print(importlib.util.find_spec('deepspeed').origin)"
    found = subprocess.run(
        [project / ".venv" / "bin" / "python", "-c", origin], capture_output=True, text=True, check=False, timeout=60
    )
    if found.stdout.strip() != importlib.util.find_spec("deepspeed").origin:
        pytest.fail(f"reader_project: its python imports DeepSpeed from {found.stdout or found.stderr}")
    return project


@pytest.fixture(scope="session")
def docs_demo(reader_project):
    """The README's and getting-started's `make demo`, run once as getting-started's block in ``reader_project``, for
    the tests that check a whole demo: checked finished (its three notebooks completed, training at its
    ``max_steps``, the scores written) before a test reads it."""
    import json

    from helpers.doc_blocks import first_block, ran
    from helpers.notebooks import FinishedDemo

    from textsql.pipeline.manifest import TRAIN, Manifest
    from textsql.pipeline.parameters import NOTEBOOKS

    terminal = ran(first_block("make demo"), reader_project)
    run_dir = reader_project / "runs" / "demo"
    records = Manifest.load(run_dir).records
    statuses = {name: records.get(name, {}).get("status") for name in NOTEBOOKS}
    assert set(statuses.values()) == {"completed"}, f"docs_demo: make demo left its notebooks {statuses}"
    max_steps = records[TRAIN]["parameters"]["max_steps"]
    trained = json.loads((run_dir / "run.json").read_text())["global_step"]
    assert trained == max_steps, f"docs_demo: make demo trained {trained} of its {max_steps} steps"
    assert (run_dir / "metrics.json").is_file(), "docs_demo: make demo wrote no metrics.json"
    return FinishedDemo(run_dir, terminal, records)


@pytest.fixture(scope="session")
def bench_checkout(tmp_path_factory) -> Path:
    """The tree as a clone has it (tests/helpers/checkout.py's ``checkout_copy``) in a directory with no ``shared`` beside
    it: where the GPU bench's CPU rehearsals run. The runs write into their own ``--out`` and ``--work``."""
    from helpers.checkout import checkout_copy, missing_from

    root = checkout_copy(tmp_path_factory.mktemp("clone") / "textsql")
    missing = missing_from(root)
    if missing:
        pytest.fail(f"bench_checkout: {len(missing)} files of the tree are not in the copy {root}: {missing[:5]}")
    if (root.parent / "shared").exists():
        pytest.fail(f"bench_checkout: {root.parent / 'shared'} is beside the copy")
    return root


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """One real S3 server for the session (SeaweedFS, bench/seaweed.py), its bucket created, checked to store and
    return an object: starting one takes seconds, and its tests keep to prefixes of their own in the bucket."""
    import contextlib

    import s3fs

    from bench.seaweed import BUCKET, s3_server

    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(s3_server(tmp_path_factory.mktemp("seaweed")))
        except AssertionError as error:  # s3_server's: the server exited, or made no bucket in time
            pytest.fail(f"s3: SeaweedFS did not start with its bucket: {error}")
        fs = s3fs.S3FileSystem(
            key=server.access_key, secret=server.secret_key, endpoint_url=server.endpoint, skip_instance_cache=True
        )
        probe = f"{BUCKET}/s3-fixture-probe"
        try:
            fs.pipe(probe, b"stored")
            returned = fs.cat(probe)
            fs.rm(probe)
        except OSError as error:
            pytest.fail(
                f"s3: the session's SeaweedFS at {server.endpoint} did not store and return an object: {error!r}"
            )
        if returned != b"stored":
            pytest.fail(f"s3: the session's SeaweedFS at {server.endpoint} returned {returned!r} for b'stored'")
        yield server


def pytest_xdist_make_scheduler(config, log):
    """`make test`'s ``--dist loadscope``: by module, the docs runs' readers together (tests/helpers/scheduling.py)."""
    if config.getvalue("dist") == "loadscope":
        return GroupScheduling(config, log)
    return None


def pytest_sessionstart(session):
    """Deliver SIGINT to what the tests start: a shell starts a background job with SIGINT ignored, and a
    child keeps an ignored signal across exec, so a suite run in the background would start launches and
    servers that the tests' interrupts cannot stop."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    """Refuse a test that starts real processes without the ``slow`` marker (`make test-fast` would start them).
    Skip the tests marked ``gpu`` on a machine without CUDA; torch is imported only when one is collected: it
    takes seconds, which a run of the fast tests or of one worker module should not pay. Refuse a test reading the
    docs runs outside the docs group, and on a pytest-xdist worker (`make test`) order the groups as
    tests/helpers/scheduling.py says."""
    unmarked = unmarked_process_tests(items)
    if unmarked:
        raise pytest.UsageError(
            f"mark these @pytest.mark.slow, they use {', '.join(sorted(PROCESS_FIXTURES))}: {', '.join(unmarked)}"
        )
    misplaced = misplaced_docs_readers(items)
    if misplaced:
        raise pytest.UsageError(
            f"these read the session's docs runs outside tests/helpers/scheduling.py's DOCS_MODULES, where `make test` "
            f"would run the demo twice: move them there or add their module: {', '.join(misplaced)}"
        )
    if hasattr(config, "workerinput"):
        order_groups(items)
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_tests:
        item.add_marker(skip)


@pytest.fixture
def loopback_sshd(tmp_path: Path):
    """A real sshd on 127.0.0.2 (as the agent starts one) accepting one fresh client key: yields (sshd, client key)."""
    from worker.network import free_port_on_all
    from worker.sshd import Sshd, generate_keypair

    identity = tmp_path / "client_key"
    public = generate_keypair(identity, "client")
    with Sshd(tmp_path / "sshd", "127.0.0.2", free_port_on_all(["127.0.0.2"]), public) as sshd:
        yield sshd, identity


@pytest.fixture
def cml_emulator(monkeypatch):
    """Puts tests/fakes first on sys.path so `import cml.workers_v1` finds the emulator."""
    monkeypatch.syspath_prepend(str(FAKES))
    for name in [m for m in sys.modules if m == "cml" or m.startswith("cml.")]:
        monkeypatch.delitem(sys.modules, name)
    import cml.workers_v1

    yield cml.workers_v1
    for name in [m for m in sys.modules if m == "cml" or m.startswith("cml.")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def _package_logs_reach_caplog():
    """Each test starts with this project's loggers as a fresh process has them: enabled, propagating, their level
    inherited. A test that runs a rank's code in-process sets the package's level as a rank does, and a library's
    logging setup can disable loggers it did not configure; tests that read ``caplog`` must not depend on order."""
    logging.disable(logging.NOTSET)
    for name, found in list(logging.root.manager.loggerDict.items()):
        if isinstance(found, logging.Logger) and name.split(".")[0] in ("textsql", "worker"):
            found.disabled, found.propagate = False, True
            if "." not in name:
                found.setLevel(logging.NOTSET)
    yield
