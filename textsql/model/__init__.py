"""Loading T5 models and tokenizers: hub ids, local directories, and the embedded small T5.

The embedded default (``textsql/assets/t5-tiny``) holds a config and the real T5 SentencePiece
vocabulary but no weights: it is a small T5 initialised from a fixed seed, sized so the offline demo
trains visibly in minutes on two CPU cores. A directory that holds weights (a trained ``model/``)
and a hub id (`t5-small`, for connected users) load with `from_pretrained`.

``speedups`` holds the changes to a loaded T5 that make its steps cheaper and leave what it computes as T5's;
``weight_copies`` the bf16 copies of its linear weights, made at each training forward, that one of them computes
from.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

if TYPE_CHECKING:
    from transformers import T5ForConditionalGeneration

from textsql.constants import DEFAULT_MODEL_DIR
from textsql.errors import ModelError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "spiece.model")
# transformers 5 silently builds a T5 tokenizer of only its special tokens when the vocabulary file
# is missing; no real vocabulary is this small.
MIN_VOCABULARY = 1000
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
INIT_SEED = 42


def resolve_model(name_or_dir: str | Path | None, flag: str = "--model") -> str:
    """Return the model reference to load: the embedded default when none is given.

    :param name_or_dir: a hub id (``t5-small``), a local directory, or ``None``/``"default"``.
    :param flag: the option that named it, for the error (``--tokenizer`` in ``textsql prepare``).
    :rtype: str
    """
    if name_or_dir in (None, "", "default"):
        return str(DEFAULT_MODEL_DIR)
    path = Path(name_or_dir).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"model {str(name_or_dir)!r} is a file; pass the directory that holds config.json")
        return str(path.resolve())
    if str(name_or_dir).startswith((".", "/", "~")):
        raise ModelError(f"model directory {str(name_or_dir)!r} does not exist; check {flag}")
    return str(name_or_dir)


def load_config(model: str | Path | None) -> PretrainedConfig:
    """Read a model's config: a model directory, a ``config.json`` file, or a hub id (needs the network).

    :rtype: transformers.PretrainedConfig
    """
    path = Path(str(model)).expanduser() if model not in (None, "", "default") else None
    try:
        if path is not None and path.is_file():
            return AutoConfig.from_pretrained(str(path.resolve()))
        return AutoConfig.from_pretrained(resolve_model(model))
    except (OSError, ValueError) as error:
        raise ModelError(
            f"cannot read a model config from {str(model)!r} ({error}); pass --model a directory with config.json, a config.json file, or a hub id on a connected machine"
        ) from None


def has_weights(model_dir: str | Path) -> bool:
    """Whether a local directory holds saved weights (rather than only a config)."""
    path = Path(model_dir)
    return path.is_dir() and any((path / name).exists() for name in WEIGHT_FILES)


def builds_from_config(name_or_dir: str | Path | None) -> bool:
    """Whether :func:`load_model` builds this model from its config (a local directory without weights, the
    embedded default among them) rather than loading trained weights."""
    reference = resolve_model(name_or_dir)
    return Path(reference).is_dir() and not has_weights(reference)


def load_tokenizer(name_or_dir: str | Path | None = None, flag: str = "--model") -> PreTrainedTokenizerBase:
    """Load the fast tokenizer of a T5 model.

    Usage::

        >>> tokenizer = load_tokenizer()          # the embedded T5 vocabulary
        >>> tokenizer("translate to SQL: hi").input_ids[-1] == tokenizer.eos_token_id
        True

    :param name_or_dir: a hub id, a model directory, or ``None`` for the embedded default.
    :param flag: the option that named it, for the errors (``--tokenizer`` in ``textsql prepare``).
    :rtype: transformers.PreTrainedTokenizerBase
    """
    reference = resolve_model(name_or_dir, flag)
    if Path(reference).is_dir() and not any((Path(reference) / name).exists() for name in TOKENIZER_FILES):
        raise ModelError(
            f"no tokenizer in {reference!r} (neither {' nor '.join(TOKENIZER_FILES)}); "
            f"copy the tokenizer files of the base model there, or pass {flag} a directory that has them"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(reference)
    except (OSError, ValueError, TypeError) as error:
        raise ModelError(
            f"cannot load a tokenizer from {reference!r} ({_first_line(error)}); pass {flag} a directory "
            "with tokenizer.json or spiece.model, or a hub id on a connected machine"
        ) from None
    if len(tokenizer) < MIN_VOCABULARY:
        raise ModelError(
            f"tokenizer at {reference!r} has only {len(tokenizer)} tokens; its vocabulary file is missing or broken"
        )
    if not tokenizer.is_fast:
        raise ModelError(f"tokenizer at {reference!r} is not a fast tokenizer; install `tokenizers` and retry")
    return tokenizer


def load_model(
    name_or_dir: str | Path | None = None,
    *,
    seed: int = INIT_SEED,
    model_class: type[T5ForConditionalGeneration] | None = None,
) -> T5ForConditionalGeneration:
    """Load a T5 model, or build the embedded default from its config.

    :param name_or_dir: a hub id, a directory with weights, a directory with only ``config.json``
        (initialised from ``seed``), or ``None`` for the embedded small T5.
    :param seed: initialisation seed for a config-only model, so every rank builds the same weights.
    :param model_class: a subclass of ``T5ForConditionalGeneration`` to build or load instead (the same weights).
    :rtype: transformers.T5ForConditionalGeneration
    """
    # Here, not at the top: the model classes double the import time of what reads only configs and
    # tokenizers (the launch's argument check among them).
    import torch
    from transformers import T5ForConditionalGeneration

    reference = resolve_model(name_or_dir)
    model_class = model_class or T5ForConditionalGeneration
    try:
        if builds_from_config(reference):
            config = AutoConfig.from_pretrained(reference)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = model_class(config)
            logger.info(
                "built %s from its config (%.1fM parameters, seed %d)", reference, model.num_parameters() / 1e6, seed
            )
            return model
        return model_class.from_pretrained(reference)
    except (OSError, ValueError) as error:
        raise ModelError(
            f"cannot load model {reference!r} ({_first_line(error)}); pass --model a trained model/ directory, "
            "a config-only directory, or a hub id on a connected machine"
        ) from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
