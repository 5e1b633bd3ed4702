"""TensorBoard at the platform's address, and the scalars of its event files for the notebooks' plots.

On Cloudera Machine Learning, a session or application serves web UIs on ``localhost`` at the port
in ``CDSW_APP_PORT`` (shown at ``https://<CDSW_ENGINE_ID>.<CDSW_DOMAIN>``) or ``CDSW_READONLY_PORT``
(``https://read-only-<CDSW_ENGINE_ID>.<CDSW_DOMAIN>``); elsewhere TensorBoard's own default,
``localhost:6006``. The training run writes its events under ``OUTPUT_DIR/tensorboard/<run name>``; the
notebooks read the same files through TensorBoard's own event multiplexer.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textsql.errors import TextSQLError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

DEFAULT_HOST = "localhost"
DEFAULT_PORT = 6006
# CML serves these on loopback and proxies them to the browser.
CML_HOST = "127.0.0.1"
# (port variable, public URL prefix) in order of preference: TensorBoard is read-only, but a CML
# application is given CDSW_APP_PORT, so that one wins where both are set.
CML_PORTS = (("CDSW_APP_PORT", ""), ("CDSW_READONLY_PORT", "read-only-"))
LOSS_TAGS = ("train/loss", "eval/loss")
# WikiSQL's scores of each evaluation's generated queries (textsql.training.metrics); execution only where tables have rows.
ACCURACY_TAGS = ("eval/lf_accuracy", "eval/ex_accuracy", "eval/parse_rate")


@dataclass(frozen=True)
class Address:
    """Where TensorBoard binds, and the URL a person opens (a CML proxy URL where there is one)."""

    host: str
    port: int
    public_url: str | None = None


def platform_address(environ: Mapping[str, str] | None = None) -> Address:
    """The address the platform expects a web UI on: CML's port variables, else localhost:6006.

    :param environ: the environment to read (``os.environ`` when None).
    :rtype: Address
    """
    environ = os.environ if environ is None else environ
    for variable, prefix in CML_PORTS:
        value = environ.get(variable)
        if not value:
            continue
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise TextSQLError(f"{variable}={value!r} is not a port number; unset it or pass --port")
        public_url = None
        if environ.get("CDSW_ENGINE_ID") and environ.get("CDSW_DOMAIN"):
            public_url = f"https://{prefix}{environ['CDSW_ENGINE_ID']}.{environ['CDSW_DOMAIN']}/"
        return Address(CML_HOST, int(value), public_url)
    return Address(DEFAULT_HOST, DEFAULT_PORT)


def start(logdir: str | Path, host: str | None = None, port: int | None = None) -> str:
    """Start TensorBoard in this process (a background thread) and return the URL it serves.

    Usage::

        >>> url = start("runs/demo/train/tensorboard")   # in a notebook: serves while the kernel runs

    :param logdir: directory searched recursively for event files.
    :param host: address to bind; the platform's when None.
    :param port: port to bind (0: any free port); the platform's when None.
    :rtype: str
    """
    from tensorboard import program

    address = platform_address()
    board = program.TensorBoard()
    board.configure(
        argv=[
            "tensorboard",
            "--logdir",
            str(Path(logdir).expanduser().resolve()),
            "--host",
            host or address.host,
            "--port",
            str(address.port if port is None else port),
        ]
    )
    try:
        url = board.launch()
    except program.TensorBoardServerException as error:
        raise TextSQLError(f"TensorBoard could not start: {error.msg}; pass another --port") from None
    logger.info("TensorBoard serving %s at %s", logdir, url)
    return url


def serve_forever(logdir: str | Path, host: str | None = None, port: int | None = None) -> None:
    """Start TensorBoard and block until interrupted (the ``textsql tensorboard`` command).

    :param logdir: directory searched recursively for event files.
    :param host: address to bind; the platform's when None.
    :param port: port to bind; the platform's when None.
    """
    url = start(logdir, host=host, port=port)
    public_url = platform_address().public_url if port is None else None
    print(f"TensorBoard on {logdir}: {url}" + (f" (open {public_url})" if public_url else ""), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass


def read_scalars(logdir: str | Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Every scalar in the event files under a directory: ``{run: {tag: [(step, value), ...]}}``.

    A run is a directory holding event files, named relative to ``logdir`` (``"."`` for the top).
    A resumed run's later events replace the ones it rewound past, as TensorBoard shows them.

    :param logdir: directory searched recursively for event files.
    :rtype: dict
    """
    from tensorboard.backend.event_processing import event_accumulator, event_multiplexer

    if not Path(logdir).is_dir():
        raise TextSQLError(f"no TensorBoard directory at {str(logdir)!r}; pass the run's tensorboard/ folder")
    multiplexer = event_multiplexer.EventMultiplexer(size_guidance={event_accumulator.SCALARS: 0})
    multiplexer.AddRunsFromDirectory(str(logdir)).Reload()
    return {
        run: {tag: [(event.step, event.value) for event in multiplexer.Scalars(run, tag)] for tag in tags["scalars"]}
        for run, tags in sorted(multiplexer.Runs().items())
    }


def plot_scalars(logdir: str | Path, tags: Iterable[str] = LOSS_TAGS) -> Figure:
    """Plot the given scalar tags of every run under ``logdir`` against the step, one line per run and tag.

    :param logdir: directory searched recursively for event files.
    :param tags: the tags to draw (train and eval loss by default).
    :rtype: matplotlib.figure.Figure
    """
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    if not _draw(axes, read_scalars(logdir), tags, "value"):
        raise TextSQLError(f"no {', '.join(tags)} scalars under {str(logdir)!r}; has training logged a step yet?")
    return figure


def plot_run(logdir: str | Path) -> Figure:
    """The loss, and beside it the evaluations' accuracy (logical form, execution, parse rate) where logged.

    Usage::

        >>> plot_run("runs/demo/tensorboard")          # doctest: +SKIP

    :param logdir: a run's ``tensorboard/`` folder (or any directory above event files).
    :raises TextSQLError: when there is no loss yet.
    :rtype: matplotlib.figure.Figure
    """
    import matplotlib.pyplot as plt

    scalars = read_scalars(logdir)
    with_accuracy = any(run.get(tag) for run in scalars.values() for tag in ACCURACY_TAGS)
    figure, panels = plt.subplots(1, 2 if with_accuracy else 1, figsize=(12 if with_accuracy else 7, 4), squeeze=False)
    if not _draw(panels[0][0], scalars, LOSS_TAGS, "loss"):
        raise TextSQLError(f"no {', '.join(LOSS_TAGS)} scalars under {str(logdir)!r}; has training logged a step yet?")
    if with_accuracy:
        _draw(panels[0][1], scalars, ACCURACY_TAGS, "share of evaluated questions")
        panels[0][1].set_ylim(-0.02, 1.02)
    figure.tight_layout()
    return figure


def _draw(axes: Axes, scalars: dict[str, Any], tags: Iterable[str], ylabel: str) -> bool:
    """Draw ``tags`` of every run on ``axes``; the run's name is in the label only when there are several."""
    for run, by_tag in scalars.items():
        for tag in tags:
            if by_tag.get(tag):
                steps, values = zip(*by_tag[tag])
                axes.plot(
                    steps,
                    values,
                    marker="." if len(steps) < 30 else None,
                    label=tag if len(scalars) == 1 else f"{run} {tag}",
                )
    if not axes.lines:
        return False
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    # A run's name is a directory the pods may write: drawn as its text, never typeset between $ signs.
    for text in axes.legend().get_texts():
        text.set_parse_math(False)
    return True
