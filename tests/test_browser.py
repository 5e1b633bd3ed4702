"""What a person sees, in a real browser: JupyterLab runs notebook 01 from its menu, TensorBoard plots a run.

Both servers are started as a user starts them (`jupyter lab`, `textsql tensorboard`) and driven by
Debian's headless chromium through its chromedriver (both installed by scripts/setup-system.sh, so
Selenium downloads nothing). Screenshots land in the test's tmp dir. Everything waits on the page's
own state (the kernel's status, execution counts, the charts' titles), never on a fixed sleep.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nbformat
import papermill
import psutil
import pytest
from helpers.tensorboard import serve, stop, wait_for_run
from ipykernel.ipkernel import IPythonKernel

from bench.tiny_run import tiny_run_argv
from textsql.display.tensorboard import read_scalars
from textsql.pipeline.parameters import check_parameters, notebook_path
from worker.network import free_port

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM and CHROMEDRIVER),
        reason="Debian's chromium and chromium-driver are absent; run scripts/setup-system.sh",
    ),
]

# Generous bounds for a shared 2-core machine; each wait ends as soon as the page is ready.
START_S = 60
RUN_ALL_S = 120
TRAIN_S = 300
TEXTSQL = str(Path(sys.executable).with_name("textsql"))
NOTEBOOK = "01_prepare_dataset"
LIMIT = 32
WINDOW = (1400, 1000)


@pytest.fixture
def browser(tmp_path: Path):
    """Headless chromium; its screenshots go to tmp_path/screenshots."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # Root in a container has no user namespace for chromium's sandbox; /dev/shm may be tiny there.
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(
        options=options, service=Service(CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    )
    (tmp_path / "screenshots").mkdir()
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver, tmp_path: Path, name: str) -> Path:
    """What the page shows now, as tmp_path/screenshots/NAME.png."""
    path = tmp_path / "screenshots" / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def wait(driver, timeout: float, condition, message: str):
    """Poll ``condition(driver)`` until it returns something true, and return that; fail with ``message``."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.5).until(condition, message)


def terminate(process: subprocess.Popen) -> None:
    """SIGTERM the server, which shuts its kernels down; kill whatever of its tree outlives that."""
    try:
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    stop(process, signal.SIGTERM)
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture
def jupyter_lab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`jupyter lab` on a free loopback port with a token, serving a copy of notebook 01 whose
    parameters papermill's way (an injected cell) point at tmp_path/data; yields (URL, data_dir).

    Its config, runtime, settings and workspaces live under tmp_path, so a user's own ~/.jupyter
    neither changes the page nor is changed by the test.
    """
    data_dir = tmp_path / "data"
    parameters = {"data_dir": str(data_dir), "limit": LIMIT}
    check_parameters(NOTEBOOK, parameters)
    served = tmp_path / "notebooks"
    served.mkdir()
    notebook = papermill.parameterize.parameterize_notebook(
        papermill.iorw.load_notebook_node(str(notebook_path(NOTEBOOK))), parameters
    )
    # The shipped file names Python's minor version only as far as test_notebooks checks it; the patch
    # level is this machine's, so the copy carries this kernel's own, as JupyterLab would save it here.
    notebook.metadata.language_info = IPythonKernel.language_info
    nbformat.write(notebook, served / f"{NOTEBOOK}.ipynb")
    # Answer the "official Jupyter news?" toast beforehand: it would cover the page's corner.
    settings = tmp_path / "lab" / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')

    port, token = free_port(), "browser-test-token"
    command = [
        str(Path(sys.executable).with_name("jupyter-lab")),
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={served}",
        f"--LabApp.user_settings_dir={settings.parent.parent}",
        f"--LabApp.workspaces_dir={tmp_path / 'lab' / 'workspaces'}",
    ]
    if os.geteuid() == 0:  # a container's root; JupyterLab refuses it otherwise
        command.append("--allow-root")
    environment = os.environ | {
        name: str(tmp_path / "jupyter" / name.lower())
        for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR")
    }
    with (tmp_path / "jupyter.log").open("w") as log:
        process = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for_http(f"{url}api/status?token={token}", process, tmp_path / "jupyter.log")
        yield f"{url}lab/tree/{NOTEBOOK}.ipynb?token={token}", data_dir
    finally:
        terminate(process)


def wait_for_http(url: str, process: subprocess.Popen, log: Path) -> None:
    """Until the server answers 200 at ``url``; fails at once with its log if it exits first."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited with {process.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"nothing answered at {url} within {START_S}s:\n{log.read_text()[-3000:]}")


def notebook_state(driver) -> dict:
    """The kernel's status (the status bar's "Python 3 (ipykernel) | Idle"), every code cell's prompt
    and output text, and the text of the outputs JupyterLab shows as stderr (warnings, progress bars)."""
    return driver.execute_script(
        """
        const kernel = document.querySelector('.jp-StatusBar-TextItem[title^="Change kernel"]');
        const cells = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')];
        return {
            status: kernel ? kernel.textContent.split('|').pop().trim() : null,
            prompts: cells.map(cell => cell.querySelector('.jp-InputPrompt').textContent.trim()),
            outputs: cells.map(cell => [...cell.querySelectorAll('.jp-OutputArea-output')].map(o => o.textContent).join('\\n')),
            stderr: [...document.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')].map(o => o.textContent),
        };
        """
    )


@pytest.mark.usefixtures("training")  # started now, so the TensorBoard test's run trains meanwhile
def test_notebook_01_runs_all_cells_from_the_jupyterlab_menu(browser, jupyter_lab, tmp_path):
    from selenium.webdriver.common.by import By

    url, data_dir = jupyter_lab
    browser.get(url)

    def opened(driver) -> bool:
        state = notebook_state(driver)
        return state["status"] == "Idle" and bool(state["prompts"])

    wait(browser, START_S, opened, "the notebook never opened with an idle kernel")
    screenshot(browser, tmp_path, "lab-1-opened")
    # By the kernel's first Idle JupyterLab has written the kernel's language_info into the notebook,
    # which marks it unsaved unless the file already carries the same (test_notebooks checks the file).
    dirty = browser.find_elements(By.CSS_SELECTOR, ".lm-TabBar-tab.jp-mod-current.jp-mod-dirty")
    assert not dirty, "JupyterLab changed the notebook on opening it: it shows as unsaved"

    browser.find_element(By.XPATH, "//li[contains(@class, 'lm-MenuBar-item')][.//div[text()='Run']]").click()
    wait(
        browser,
        10,
        lambda driver: driver.find_element(By.CSS_SELECTOR, "li[data-command='runmenu:run-all']"),
        "the Run menu has no Run All Cells",
    ).click()

    def finished(driver) -> dict | bool:
        state = notebook_state(driver)
        ran = all(re.fullmatch(r"\[\d+\]:", prompt) for prompt in state["prompts"])
        failed = any("Traceback" in output for output in state["outputs"])
        return state if state["status"] == "Idle" and (ran or failed) else False

    state = wait(browser, RUN_ALL_S, finished, "Run All Cells did not finish")
    summary = browser.find_element(By.XPATH, "//div[contains(@class, 'jp-OutputArea-output')][contains(., 'wrote ')]")
    browser.execute_script("arguments[0].scrollIntoView()", summary)
    screenshot(browser, tmp_path, "lab-2-summary")
    text = "\n".join(state["outputs"])
    assert "Traceback" not in text, text[-3000:]
    assert state["stderr"] == [], "third-party noise reached the notebook (log_level is warning)"
    assert [int(prompt[1:-2]) for prompt in state["prompts"]] == list(range(1, len(state["prompts"]) + 1)), (
        "each cell ran once, in order"
    )
    assert f"wrote {data_dir} (uncased input, tokenizer" in text
    for split in ("train", "validation", "test"):
        assert re.search(rf"{split}: {LIMIT} questions, \d+ tables", text), f"no {split} line in:\n{text}"
    assert (data_dir / "dataset_dict.json").is_file() and (data_dir / "prepare.json").is_file(), (
        "the kernel really wrote the dataset"
    )

    figure = browser.find_element(By.CSS_SELECTOR, ".jp-OutputArea-output img")
    browser.execute_script("arguments[0].scrollIntoView()", figure)
    assert browser.execute_script("return arguments[0].naturalWidth", figure) > 0, (
        "the token length histograms did not render"
    )
    screenshot(browser, tmp_path, "lab-3-histograms")
    table = browser.find_element(By.CSS_SELECTOR, ".jp-OutputArea-output table")
    browser.execute_script("arguments[0].scrollIntoView()", table)
    headers = [cell.get_attribute("textContent").strip() for cell in table.find_elements(By.CSS_SELECTOR, "thead th")]
    assert headers[-3:] == ["question", "source_text", "target"]
    assert len(table.find_elements(By.CSS_SELECTOR, "tbody tr")) == 5
    screenshot(browser, tmp_path, "lab-4-examples")


@pytest.fixture(scope="module")
def training(prepared_sample: Path, tmp_path_factory) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A real `textsql train` of 4 steps on the prepared sample (one process, the embedded small T5,
    evaluated every 2 steps), started in the background: it trains while JupyterLab runs notebook 01,
    which keeps the module well under two minutes. Yields the process and its output dir."""
    output = tmp_path_factory.mktemp("training") / "run"
    argv = tiny_run_argv(
        prepared_sample,
        output,
        max_steps=4,
        eval_every=2,
        learning_rate=3e-3,
        max_eval_samples=4,
        per_device_eval_batch_size=4,
    )
    with (output.parent / "train.log").open("w") as log:
        process = subprocess.Popen(
            [TEXTSQL, "train", *argv], stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "1"}
        )
    try:
        yield process, output
    finally:
        terminate(process)


@pytest.fixture
def finished_run(training: tuple[subprocess.Popen, Path]) -> Path:
    """The background run, waited for; its output dir holds tensorboard/."""
    process, output = training
    assert process.wait(timeout=TRAIN_S) == 0, (output.parent / "train.log").read_text()[-3000:]
    return output


def scalar_cards(driver) -> dict[str, dict[str, list[str]]]:
    """Time Series' scalar cards as a person reads them: tag -> the card's table, column -> one cell per run.

    A card draws itself only once it is scrolled into view, so each call scrolls the next card not
    drawn yet into view, as a person reading down the page would; call it until every tag is there.
    """
    return driver.execute_script(
        """
        const cards = {};
        const text = element => element.textContent.trim();
        for (const card of document.querySelectorAll('scalar-card')) {
            const title = card.querySelector('.tag');
            if (!title) continue;
            const headers = [...card.querySelectorAll('tb-data-table-header-cell')].map(text);
            const rows = [...card.querySelectorAll('tb-data-table-content-row')].map(row => [...row.querySelectorAll('tb-data-table-content-cell')].map(text));
            cards[title.getAttribute('title')] = Object.fromEntries(headers.map((header, i) => [header, rows.map(row => row[i])]));
        }
        const undrawn = [...document.querySelectorAll('card-view-component')].find(view => !view.firstElementChild);
        if (undrawn) undrawn.scrollIntoView();
        return cards;
        """
    )


def test_tensorboard_plots_every_scalar_of_a_finished_run(browser, finished_run, tmp_path):
    logdir = finished_run / "tensorboard"
    scalars = read_scalars(logdir)
    written = {tag for tags in scalars.values() for tag in tags}
    assert {"train/loss", "eval/loss"} <= written
    process, url = serve(logdir, "--host", "127.0.0.1", "--port", "0")
    try:
        for run in scalars:
            wait_for_run(url, run)
        browser.get(url)  # Time Series, TensorBoard's first dashboard

        def every_card(driver) -> dict | bool:
            cards = scalar_cards(driver)
            return cards if cards.keys() >= written else False

        cards = wait(browser, START_S, every_card, f"TensorBoard did not show a chart for each of {sorted(written)}")
        for tag in ("eval/loss", "train/loss"):
            browser.execute_script(
                "document.querySelector(`.tag[title='${arguments[0]}']`).closest('card-view').scrollIntoView({block: 'center'})",
                tag,
            )
            screenshot(browser, tmp_path, f"tensorboard-{tag.replace('/', '-')}")
    finally:
        stop(process)
    # Every scalar the run wrote has its chart, the eval accuracies with the losses, and nothing else.
    assert set(cards) == written
    ((run, losses),) = ((run, tags["train/loss"]) for run, tags in scalars.items() if "train/loss" in tags)
    loss = cards["train/loss"]
    assert loss["Run"] == [run] and loss["Step"] == [str(losses[-1][0])]
    assert float(loss["Value"][0]) == pytest.approx(losses[-1][1], abs=1e-3), (
        "the chart's table shows the last logged loss"
    )
