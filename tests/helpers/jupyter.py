"""JupyterLab started as a user starts it (`jupyter lab`), serving one notebook with its parameters set, and what
its page shows: the kernel's status, each cell's prompt and output, Run All from the menu.

The browser tests drive it with Debian's headless chromium (tests/test_browser.py). Everything waits on the
page's own state (the kernel's status, execution counts), never on a fixed sleep.
"""

from __future__ import annotations

import contextlib
import os
import re
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
from ipykernel.ipkernel import IPythonKernel

from helpers.tensorboard import stop
from textsql.pipeline.parameters import check_parameters, notebook_path
from worker.network import free_port

# Generous bounds for a shared 2-core machine; each wait ends as soon as the page is ready.
START_S = 60
TOKEN = "browser-test-token"


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


@contextlib.contextmanager
def serve_notebook(tmp_path: Path, notebook: str, parameters: dict) -> Iterator[str]:
    """`jupyter lab` on a free loopback port with a token, serving from tmp_path/notebooks a copy of ``notebook``
    whose parameters papermill's way (an injected cell) are ``parameters``; yields the notebook's URL.

    Its config, runtime, settings and workspaces live under tmp_path, so a user's own ~/.jupyter
    neither changes the page nor is changed by the test.
    """
    check_parameters(notebook, parameters)
    served = tmp_path / "notebooks"
    served.mkdir()
    copy = papermill.parameterize.parameterize_notebook(
        papermill.iorw.load_notebook_node(str(notebook_path(notebook))), parameters
    )
    # The shipped file names Python's minor version only as far as test_notebooks checks it; the patch
    # level is this machine's, so the copy carries this kernel's own, as JupyterLab would save it here.
    copy.metadata.language_info = IPythonKernel.language_info
    nbformat.write(copy, served / f"{notebook}.ipynb")
    # Answer the "official Jupyter news?" toast beforehand: it would cover the page's corner.
    settings = tmp_path / "lab" / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')

    port = free_port()
    command = [
        str(Path(sys.executable).with_name("jupyter-lab")),
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={TOKEN}",
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
        wait_for_http(f"{url}api/status?token={TOKEN}", process, tmp_path / "jupyter.log")
        yield f"{url}lab/tree/{notebook}.ipynb?token={TOKEN}"
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


def wait(driver, timeout: float, condition, message: str):
    """Poll ``condition(driver)`` until it returns something true, and return that; fail with ``message``."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.5).until(condition, message)


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


def opened(driver) -> bool:
    """Whether the notebook shows its cells and an idle kernel."""
    state = notebook_state(driver)
    return state["status"] == "Idle" and bool(state["prompts"])


def run_all(driver) -> None:
    """Run ▸ Run All Cells, from the menu, as a person does."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.XPATH, "//li[contains(@class, 'lm-MenuBar-item')][.//div[text()='Run']]").click()
    wait(
        driver,
        10,
        lambda page: page.find_element(By.CSS_SELECTOR, "li[data-command='runmenu:run-all']"),
        "the Run menu has no Run All Cells",
    ).click()


def finished(driver) -> dict | bool:
    """The notebook's state once Run All has ended (every cell ran, or one failed), else False."""
    state = notebook_state(driver)
    ran = all(re.fullmatch(r"\[\d+\]:", prompt) for prompt in state["prompts"])
    failed = any("Traceback" in output for output in state["outputs"])
    return state if state["status"] == "Idle" and (ran or failed) else False
