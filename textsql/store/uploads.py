"""The master's thread that copies each new complete checkpoint to the store while training goes on.

It looks at the run directory every :data:`POLL_S` seconds for checkpoints the ranks marked complete and not yet
in the store, and uploads them oldest first, one at a time: a checkpoint completed while another is in flight
waits, and the wait is logged. A checkpoint the trainer rotated away before its upload ended is skipped (a newer
one follows). A failed upload is retried with backoff; when the tries are spent, :attr:`StoreUploads.failure`
says so in one line, and the supervisor ends the run with it rather than leave a gap in the store.

Each upload's bytes and seconds are logged and kept in :attr:`StoreUploads.record`, which the run's ``run.json``
carries (key ``checkpoint_store``).

Usage::

    >>> with StoreUploads(store, Path("runs/r1"), keep=2) as uploads:
    ...     train()  # the supervisor's launches
    ...     uploads.finish()
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Self

from textsql.constants import RUN_SUMMARY_NAME
from textsql.errors import StoreError
from textsql.json_files import read_json, write_json
from textsql.rank_lines import STAGE_PREFIX
from textsql.rundir.checkpoints import COMPLETE_MARKER, checkpoint_dirs, is_complete_checkpoint, ranks_missing
from textsql.store.location import Store, check_store, open_store, refusal
from textsql.store.sync import (
    apply_retention,
    clear_checkpoints,
    complete_steps,
    download_newest,
    upload_checkpoint,
    upload_outputs,
)

logger = logging.getLogger(__name__)

POLL_S = 2.0
TRIES = 4
FIRST_BACKOFF_S = 1.0


class StoreUploads:
    """Uploads a run directory's complete checkpoints to a store in a background thread (see the module docstring).

    :param store: the opened store.
    :param output: the training's output directory.
    :param keep: how many complete checkpoints the store keeps (the trainer's ``save_total_limit``; None: all).
    :param poll_s: seconds between two looks at the run directory.
    :param tries: uploads of one checkpoint before the run is ended.
    :param backoff_s: the first wait between two tries (doubled each time).
    """

    def __init__(
        self,
        store: Store,
        output: Path,
        keep: int | None = None,
        poll_s: float = POLL_S,
        tries: int = TRIES,
        backoff_s: float = FIRST_BACKOFF_S,
    ):
        self.store, self.output, self.keep = store, output, keep
        self.poll_s, self.tries, self.backoff_s = poll_s, tries, backoff_s
        self.failure: str | None = None
        #: Ranks of the launch writing checkpoints now (the supervisor sets it before each launch): a checkpoint
        #: without every rank's files is not uploaded, and ends the run.
        self.ranks = 1
        self.record: dict = {"store": store.uri, "checkpoints": [], "outputs": None}
        self._uploaded = set(complete_steps(store))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="checkpoint-store", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def failed(self) -> bool:
        """Whether an upload failed for good (the supervisor's stop condition).

        :rtype: bool
        """
        return self.failure is not None

    def finish(self) -> None:
        """After the run: the checkpoints not yet uploaded, the record in ``run.json``, then the outputs (``model/``,
        ``run.json``, the metrics, the event files).

        :raises StoreError: when an upload failed for good, now or before.
        """
        self._stop.set()
        self._thread.join()
        self._upload_pending()
        summary = self.output / RUN_SUMMARY_NAME
        if self.failure is None and summary.is_file():
            write_json(summary, read_json(summary) | {"checkpoint_store": self.record})
        if self.failure is None:
            started = time.monotonic()
            copied = self._with_retries("the run's outputs", partial(upload_outputs, self.store, self.output))
            if copied is not None:
                self.record["outputs"] = {"bytes": copied, "seconds": round(time.monotonic() - started, 3)}
        if self.failure is not None:
            raise StoreError(self.failure)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s) and self.failure is None:
            try:
                self._upload_pending()
            except Exception as error:  # noqa: BLE001 - a thread that died silently would leave gaps unsaid
                self.failure = f"checkpoint store {self.store.where()}: {type(error).__name__}: {error}"
                logger.error("%s", self.failure)

    def _pending(self) -> list[Path]:
        return [
            path
            for path in checkpoint_dirs(self.output)
            if int(path.name.rpartition("-")[2]) not in self._uploaded and is_complete_checkpoint(path)
        ]

    def _upload_pending(self) -> None:
        previous, finished_at = "", 0.0
        while self.failure is None and (pending := self._pending()):
            checkpoint = pending[0]
            missing = ranks_missing(checkpoint, self.ranks)
            if missing:
                self.failure = (
                    f"checkpoint store {self.store.where()}: {checkpoint} lacks the files of rank(s) "
                    f"{', '.join(map(str, missing))} of {self.ranks}, so the hosts do not share the run directory and "
                    "their shards never reach this machine; give every host the same shared run directory, or train "
                    "without a checkpoint store"
                )
                logger.error("%s", self.failure)
                return
            waited = _waited(checkpoint, finished_at)
            if waited:
                logger.warning(
                    "checkpoint store: %s waited %.1f s for %s's upload (one in flight)",
                    checkpoint.name,
                    waited,
                    previous,
                )
            started = time.monotonic()
            copied = self._with_retries(checkpoint.name, partial(upload_checkpoint, self.store, checkpoint))
            if copied is None:
                continue
            seconds = round(time.monotonic() - started, 3)
            self._uploaded.add(int(checkpoint.name.rpartition("-")[2]))
            self.record["checkpoints"].append(
                {"name": checkpoint.name, "bytes": copied, "seconds": seconds, "waited_s": round(waited, 3)}
            )
            # A stage line: the demo's terminal shows it between its step bar's redraws, as it does the ranks' own.
            print(
                f"{STAGE_PREFIX}checkpoint store: {checkpoint.name} uploaded to {self.store.uri} "
                f"({copied / 1e6:.1f} MB in {seconds:.1f} s)",
                flush=True,
            )
            try:
                apply_retention(self.store, self.keep)
            except (OSError, ValueError) as error:
                # Nothing is missing from the store, only too much kept: the next checkpoint's retention tries again.
                logger.warning("checkpoint store: retention after %s failed (%s)", checkpoint.name, refusal(error))
            previous, finished_at = checkpoint.name, time.time()

    def _with_retries(self, what: str, upload: Callable[[], int]) -> int | None:
        """``upload()``'s bytes, tried :attr:`tries` times; None when the tries are spent or the files vanished."""
        for attempt in range(1, self.tries + 1):
            try:
                return upload()
            except FileNotFoundError as error:
                if not (self.output / what).exists() and what.startswith("checkpoint-"):
                    logger.warning("checkpoint store: %s was rotated away before its upload ended; skipped", what)
                    self._uploaded.add(int(what.rpartition("-")[2]))
                    return None
                reason = refusal(error)
            except (OSError, ValueError) as error:
                reason = refusal(error)
            if attempt < self.tries:
                wait = self.backoff_s * 2 ** (attempt - 1)
                logger.warning(
                    "checkpoint store: uploading %s failed (%s); try %d in %.0f s", what, reason, attempt + 1, wait
                )
                time.sleep(wait)
        self.failure = f"checkpoint store {self.store.where()}: uploading {what} failed {self.tries} times: {reason}"
        logger.error("%s", self.failure)
        return None


def _waited(checkpoint: Path, finished_at: float) -> float:
    """How long ``checkpoint`` had been complete when the upload before it ended at ``finished_at`` (0: no upload
    before it in this round)."""
    if not finished_at:
        return 0.0
    return max(0.0, finished_at - (checkpoint / COMPLETE_MARKER).stat().st_mtime)


@contextlib.contextmanager
def store_uploads(
    uri: str | None,
    output: Path | None,
    keep: int | None = None,
    resume_from_checkpoint: str | None = None,
    overwrite: bool = False,
) -> Iterator[StoreUploads | None]:
    """With a checkpoint store: the store checked (one line if it cannot be used), its newest complete checkpoint
    downloaded into an output directory that holds none as new (``--resume-from-checkpoint auto``), and its uploads running.

    :param uri: the ``--checkpoint-store`` (None: no store, nothing happens).
    :param output: the training's output directory.
    :param keep: the training's ``save_total_limit``.
    :param resume_from_checkpoint: the training's ``--resume-from-checkpoint``.
    :param overwrite: the training's ``--overwrite-output-dir``: a previous run's checkpoints in the store are
        deleted, as in the output directory; without it (and ``--resume-from-checkpoint auto``) a store holding some is refused.
    :rtype: typing.Iterator[StoreUploads | None]
    :raises StoreError: when the store cannot be used, or holds a previous run it may not resume or replace.
    """
    if uri is None or output is None:
        yield None
        return
    store = open_store(uri)
    check_store(store)
    previous = complete_steps(store) if resume_from_checkpoint != "auto" else []
    if previous and not overwrite:
        raise StoreError(
            f"checkpoint store {uri} holds checkpoint-{previous[-1]} of a previous run; pass --resume-from-checkpoint auto to resume "
            "it, --overwrite-output-dir to replace it, or another store prefix"
        )
    if previous:
        logger.warning("checkpoint store: deleting %s's checkpoints of a previous run (--overwrite-output-dir)", uri)
        clear_checkpoints(store)
    if resume_from_checkpoint == "auto":
        started = time.monotonic()
        restored = download_newest(store, output)
        if restored is not None:
            logger.info(
                "checkpoint store: %s downloaded from %s in %.1f s", restored.name, uri, time.monotonic() - started
            )
    with StoreUploads(store, output, keep=keep) as uploads:
        yield uploads
