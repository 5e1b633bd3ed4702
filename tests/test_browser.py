"""What a person sees, in a real browser: JupyterLab runs notebook 01 from its menu, and notebook 03 with a
worker's hostile question (which stays text), TensorBoard plots a run.

Both servers are started as a user starts them (`jupyter lab`, `textsql tensorboard`) and driven by
Debian's headless chromium through its chromedriver (both installed by scripts/setup-system.sh, so
Selenium downloads nothing). Screenshots land in the test's tmp dir. Everything waits on the page's
own state (the kernel's status, execution counts, the charts' titles, a control's handler), never on a fixed
sleep.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.jupyter import START_S, finished, opened, run_all, serve_notebook, terminate, wait
from helpers.tensorboard import serve, stop, wait_for_run

from bench.tiny_run import tiny_run_argv
from textsql.display.tensorboard import read_scalars

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


@pytest.fixture
def jupyter_lab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """JupyterLab serving notebook 01 with its data_dir at tmp_path/data; yields (URL, data_dir)."""
    data_dir = tmp_path / "data"
    with serve_notebook(tmp_path, NOTEBOOK, {"data_dir": str(data_dir), "limit": LIMIT}) as url:
        yield url, data_dir


@pytest.mark.usefixtures("training")  # started now, so the TensorBoard test's run trains meanwhile
def test_notebook_01_runs_all_cells_from_the_jupyterlab_menu(browser, jupyter_lab, tmp_path):
    from selenium.webdriver.common.by import By

    url, data_dir = jupyter_lab
    browser.get(url)
    wait(browser, START_S, opened, "the notebook never opened with an idle kernel")
    screenshot(browser, tmp_path, "lab-1-opened")
    # By the kernel's first Idle JupyterLab has written the kernel's language_info into the notebook,
    # which marks it unsaved unless the file already carries the same (test_notebooks checks the file).
    dirty = browser.find_elements(By.CSS_SELECTOR, ".lm-TabBar-tab.jp-mod-current.jp-mod-dirty")
    assert not dirty, "JupyterLab changed the notebook on opening it: it shows as unsaved"

    run_all(browser)
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


# A question a worker wrote where notebook 03 reads its questions: live HTML, its script would mark the page and,
# with the page's _xsrf cookie, write a file through Jupyter's contents API (the API that also starts kernels).
MARKER = "written-by-a-worker.txt"
HOSTILE_QUESTION = (
    '<img src=x onerror="window.workerScriptRan = true; '
    f"fetch('/api/contents/{MARKER}', {{method: 'PUT', "
    "headers: {'X-XSRFToken': document.cookie.match(/_xsrf=([^;]*)/)[1]}, "
    "body: JSON.stringify({type: 'file', format: 'text', content: 'a worker wrote this'})})\">"
    " how many wear $3$?"
)


@pytest.fixture
def hostile_questions(tmp_path: Path) -> tuple[Path, Path]:
    """A run directory holding a model (the small T5 as built, untrained: what it answers does not matter here)
    and a questions file whose first question is :data:`HOSTILE_QUESTION`; returns (run_dir, questions)."""
    from textsql.json_files import write_jsonl
    from textsql.model import load_model, load_tokenizer

    run_dir = tmp_path / "run"
    load_model("default").save_pretrained(run_dir / "model")
    load_tokenizer("default").save_pretrained(run_dir / "model")
    header = ["Player", "No."]
    questions = [
        {"id": "1", "question": HOSTILE_QUESTION, "header": header, "sql": {"sel": 0, "agg": 3, "conds": []}},
        {"id": "2", "question": "who wears 3?", "header": header, "sql": {"sel": 0, "agg": 0, "conds": [[1, 0, "3"]]}},
    ]
    return run_dir, write_jsonl(tmp_path / "questions.jsonl", questions)


def test_a_worker_written_question_runs_no_script_in_notebook_03_and_reads_as_text(
    browser, hostile_questions, tmp_path
):
    """Run All in JupyterLab, as a person runs notebook 03: its predictions tables show the question."""
    from selenium.webdriver.common.by import By

    run_dir, questions = hostile_questions
    parameters = {"run_dir": str(run_dir), "data_dir": str(questions), "real_source": "", "max_new_tokens": 32}
    with serve_notebook(tmp_path, "03_inference", parameters) as url:
        browser.get(url)
        wait(browser, START_S, opened, "the notebook never opened with an idle kernel")
        run_all(browser)
        state = wait(browser, RUN_ALL_S, finished, "Run All Cells did not finish")
        assert "Traceback" not in "\n".join(state["outputs"]), "\n".join(state["outputs"])[-3000:]
        cells = browser.find_elements(
            By.XPATH, "//div[contains(@class, 'jp-OutputArea-output')]//td[contains(., 'how many wear')]"
        )
        browser.execute_script("arguments[0].scrollIntoView()", cells[0])
        screenshot(browser, tmp_path, "lab-hostile-question")
        # The control: the same broken image, put in the page after the tables. Once its handler has run, the
        # question's would have run too, had the question been live HTML.
        browser.execute_script(
            "document.body.insertAdjacentHTML('beforeend', '<img src=x onerror=\"window.controlRan = true\">')"
        )
        wait(browser, 10, lambda driver: driver.execute_script("return window.controlRan"), "the control never ran")
        ran = browser.execute_script("return window.workerScriptRan === true")
        elements = browser.execute_script("return document.querySelectorAll('.jp-OutputArea-output td *').length")
        shown = [cell.get_attribute("textContent") for cell in cells]
    assert not ran, "the worker's question ran as HTML in the notebook, its script in the page"
    assert not (tmp_path / "notebooks" / MARKER).exists(), "the worker's script wrote a file through Jupyter"
    assert elements == 0, "the question became elements in the tables: HTML, or math MathJax typeset"
    assert shown == [HOSTILE_QUESTION] * 2, "both tables (the first predictions, the worst) show it as its text"
