"""A T5 model that writes WikiSQL SQL for questions: batched generation, and one question answered.

:class:`Predictor` holds a model and its tokenizer on the best device (CUDA when present). It
generates in batches sorted by input length (longest first, so little is padding and an
out-of-memory shows in the first batch), with attention masks, greedy unless ``num_beams > 1``,
constrained by default to the WikiSQL grammar of each question's table (:mod:`textsql.decoding.grammar`) and,
with beams and tables that carry rows, guided by execution (:mod:`textsql.inference.guidance`), and returns
results in the input order. :func:`ask` answers one question written by a user about a table header;
:func:`textsql.inference.predict.predict` runs a whole split through it.

The model's input text is :func:`textsql.data.wikisql.source_text`, the function ``textsql prepare`` uses;
answers are read back with :func:`textsql.data.sql.parse_sql`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm
from transformers import LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from textsql.arguments import GenerationOptions
from textsql.constants import DEFAULT_MAX_SOURCE_LENGTH, INPUT_FORMATS, UNCASED_FORMAT
from textsql.data.sql import parsed
from textsql.data.wikisql import cased_sql, recorded_input_format, source_text
from textsql.decoding.processor import grammar_processor, processor_for_inputs
from textsql.errors import DataError, ModelError
from textsql.inference.guidance import ExecutionGuide
from textsql.model import has_weights, load_model, load_tokenizer, resolve_model
from textsql.model.speedups import fuse_norms

logger = logging.getLogger(__name__)


class Predictor:
    """A model, its tokenizer and input format, ready to write SQL.

    Usage::

        >>> predictor = Predictor.load("runs/demo/model")           # doctest: +SKIP
        >>> predictor.ask("How many schools did player number 3 play at?",
        ...               ["Player", "No.", "Nationality", "Position", "Years in Toronto", "School/Club Team"])  # doctest: +SKIP
        {'sql': 'SELECT COUNT School/Club Team FROM table WHERE No. = 3', 'query': {...}, 'error': None}
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        input_format: str = INPUT_FORMATS[0],
        device: str | torch.device | None = None,
        model_dir: Path | None = None,
    ):
        if input_format not in INPUT_FORMATS:
            raise DataError(f"unknown input format {input_format!r}; pass --input-format {' or '.join(INPUT_FORMATS)}")
        self.device = _device(device)
        # transformers types .to through a decorator that mypy reads as taking the model again.
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.tokenizer = tokenizer
        self.input_format = input_format
        # Where the model was loaded from: evaluation scores go into its model card there.
        self.model_dir = model_dir

    @property
    def uncased(self) -> bool:
        """Whether the model writes its queries in lower case (the ``uncased`` input format)."""
        return self.input_format == UNCASED_FORMAT

    @classmethod
    def load(
        cls, model_dir: str | Path | None = None, input_format: str | None = None, device: str | None = None
    ) -> Predictor:
        """Load a trained model directory (weights, config, tokenizer).

        :param model_dir: ``from_pretrained`` directory or hub id; ``None`` is the untrained embedded T5.
        :param input_format: ``schema``, ``question`` or ``uncased``; by default the one recorded in the model
            directory's ``prepare.json``, else ``schema``.
        :param device: ``cuda``, ``cpu``, ...; by default CUDA when present.
        :rtype: Predictor
        """
        reference = resolve_model(model_dir)
        if Path(reference).is_dir() and not has_weights(reference):
            logger.warning("%s holds no weights: predictions come from an untrained model", reference)
        model = load_model(reference)
        # Generation runs the decoder's norms once a token: one kernel each on CUDA instead of six.
        fuse_norms(model)
        return cls(
            model,
            load_tokenizer(reference),
            input_format or recorded_input_format(reference),
            device,
            Path(reference) if Path(reference).is_dir() else None,
        )

    def generate(
        self,
        input_ids: Sequence[list[int]],
        options: GenerationOptions | None = None,
        progress: bool = False,
        items: Sequence[dict] | None = None,
        tables: dict[str, dict] | None = None,
    ) -> list[str]:
        """SQL text for each tokenized input, in the input order.

        :param input_ids: token ids per question (unpadded, ending in ``</s>``).
        :param options: batch size and decoding; defaults of :class:`GenerationOptions`.
        :param progress: show a progress bar.
        :param items: per input, its ``question`` and ``header`` (and ``table_id``), which constrained
            decoding follows; by default they are read back from the input text.
        :param tables: ``{table_id: table}``; with rows and beams, decoding is execution-guided.
        :rtype: list[str]
        """
        options = options or GenerationOptions()
        order = sorted(range(len(input_ids)), key=lambda index: -len(input_ids[index]))
        texts: list[str] = [""] * len(input_ids)
        guided = bool(items and tables and options.execution_guided and options.num_beams > 1)
        with (
            ExecutionGuide(tables if guided and tables else {}) as guide,
            tqdm(total=len(order), desc="Generating", unit="q", disable=not progress, file=_progress_stream()) as bar,
            torch.inference_mode(),
        ):
            for start in range(0, len(order), options.batch_size):
                chunk = order[start : start + options.batch_size]
                batch = self.tokenizer.pad(
                    [{"input_ids": input_ids[index]} for index in chunk], return_tensors="pt"
                ).to(self.device)
                returned = options.num_beams if guided else 1
                output = self.model.generate(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    do_sample=False,
                    num_beams=options.num_beams,
                    max_new_tokens=options.max_new_tokens,
                    num_return_sequences=returned,
                    logits_processor=self._constraint(
                        batch["input_ids"], [items[index] for index in chunk] if items else None, options
                    ),
                )
                decoded = [text.strip() for text in self.tokenizer.batch_decode(output, skip_special_tokens=True)]
                for position, index in enumerate(chunk):
                    beams = decoded[position * returned : (position + 1) * returned]
                    texts[index] = (
                        guide.choose(beams, items[index]["header"], items[index].get("table_id"))
                        if guided and items
                        else beams[0]
                    )
                    if self.uncased and items:
                        texts[index] = cased_sql(texts[index], items[index]["question"], items[index]["header"])
                bar.update(len(chunk))
        return texts

    def _constraint(
        self, input_ids: torch.Tensor, items: list[dict] | None, options: GenerationOptions
    ) -> LogitsProcessorList | None:
        """The grammar of each question's table for one batch, or ``None`` when decoding is free."""
        if not options.constrained:
            return None
        if items is None:
            return LogitsProcessorList(
                [processor_for_inputs(self.tokenizer, input_ids, options.max_new_tokens, self.uncased)]
            )
        processor = grammar_processor(
            self.tokenizer,
            [item["question"] for item in items],
            [item["header"] for item in items],
            options.max_new_tokens,
            self.uncased,
        )
        return LogitsProcessorList([processor])

    def encode(self, question: str, header: list[str], max_source_length: int = DEFAULT_MAX_SOURCE_LENGTH) -> list[int]:
        """Token ids of the model input for one question, built as ``textsql prepare`` builds them.

        :rtype: list[int]
        """
        return self.tokenizer(
            source_text(question, header, self.input_format), truncation=True, max_length=max_source_length
        )["input_ids"]

    def ask(self, question: str, header: list[str], options: GenerationOptions | None = None) -> dict:
        """Answer one question about a table with this header.

        :param question: English question.
        :param header: the table's column names, in order.
        :param options: decoding options (beams, max new tokens).
        :returns: ``{"sql": text, "query": {sel, agg, conds} or None, "error": None or why it did not parse}``.
        :rtype: dict
        """
        options = options or GenerationOptions()
        if not question.strip():
            raise DataError("the question is empty; pass --question 'How many ...?'")
        if not header:
            raise DataError("no table header; pass --header 'Column A,Column B,...'")
        text = self.generate(
            [self.encode(question, header, options.max_source_length)],
            options,
            items=[{"question": question, "header": header}],
        )[0]
        return {"sql": text, **parsed(text, header)}


def _progress_stream() -> TextIO:
    """Where the progress bar goes: stdout in a notebook kernel, where its carriage returns keep it one updating
    line (stderr there is a red block holding every update, and tqdm's widget needs ipywidgets); else stderr."""
    return sys.stdout if "ipykernel" in sys.modules else sys.stderr


def _device(name: str | torch.device | None) -> torch.device:
    """The device to generate on: the one named, else CUDA when present, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ModelError(f"unknown device {str(name)!r}; pass --device cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {str(name)!r} asked for but this machine has no CUDA GPU; pass --device cpu")
    return device


def ask(model: str | Path | Predictor | None, question: str, header: list[str], **options: Any) -> dict:
    """Answer one question about a table header (loads the model when given a directory).

    Usage::

        >>> ask("runs/demo/model", "Who is number 3?", ["Player", "No."])   # doctest: +SKIP
        {'sql': 'SELECT Player FROM table WHERE No. = 3', 'query': {'sel': 0, 'agg': 0, 'conds': [[1, 0, '3']]}, 'error': None}

    :param model: a :class:`Predictor` or a model directory / hub id.
    :param question: the question.
    :param header: the table's column names.
    :param options: :class:`GenerationOptions` fields (``num_beams``, ``max_new_tokens``, ``constrained``).
    :rtype: dict
    """
    predictor = model if isinstance(model, Predictor) else Predictor.load(model)
    return predictor.ask(question, header, GenerationOptions(**options))
