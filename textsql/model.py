"""Loading T5 models and tokenizers: hub ids, local directories, and the embedded small T5.

The embedded default (``textsql/assets/t5-tiny``) holds a config and the real T5 SentencePiece
vocabulary but no weights: it is a small T5 initialised from a fixed seed, sized so the offline demo
trains visibly in minutes on two CPU cores. A directory that holds weights (a trained ``model/``)
and a hub id (``t5-small``, for connected users) load with ``from_pretrained``.

Below the loading, the changes to a loaded T5 that make its steps cheaper on a GPU and leave what it computes as
T5's: the weights keep their names, and saved models load as T5 everywhere.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch.utils.weak import WeakIdKeyDictionary
    from transformers import T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5DenseActDense, T5DenseGatedActDense

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
# The name transformers' attention registry knows the training step's SDPA attention by (share_attention_bias).
SHARED_BIAS_ATTENTION = "sdpa_shared_bias"


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


def fuse_norms(model: torch.nn.Module) -> int:
    """Swap each of T5's norms for torch's ``RMSNorm`` holding the same weight; return how many were swapped.

    T5's own norm writes RMS normalisation out as six operators (square, mean, add, rsqrt and two products), each
    a GPU kernel, and more in the backward: with 32 norms in t5-small and 62 in t5-base, hundreds of kernels a
    step. ``torch.nn.functional.rms_norm`` computes the same thing (accumulating in fp32) and on CUDA dispatches
    to one fused kernel forward and one backward (``_fused_rms_norm``); on a CPU it runs T5's operators in T5's
    order, to the same bits. The weights keep their names, so checkpoints and ``model/`` load into
    ``T5ForConditionalGeneration`` as before.

    :param model: a T5, changed in place.
    :rtype: int
    """
    import torch
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, T5LayerNorm):
                # A weight ZeRO-3 partitioned when the model was built is empty but for its ds_shape.
                shape = getattr(child.weight, "ds_shape", child.weight.shape)
                # Built on the meta device: its own weight is replaced by the one the model already holds.
                norm = torch.nn.RMSNorm(shape, eps=child.variance_epsilon, device="meta")
                norm.weight = child.weight
                setattr(parent, name, norm)
                swapped += 1
    return swapped


def skip_feed_forward_upcast(model: torch.nn.Module) -> int:
    """Let each of T5's feed-forward blocks, under autocast, hand its activation to its output layer as it is; return
    how many blocks.

    T5's feed-forward casts its activation to the dtype of its output layer's weight first (T5 keeps that layer in
    fp32 when loaded in fp16 or int8). Under autocast the weight is fp32, and autocast casts the input straight back:
    the block's widest activation (``d_ff``) is written once more in fp32 and read again, and two casts run forward
    and two backward, in every layer. bf16 to fp32 and back is exact, so leaving both out changes no bit
    (``tests/test_model.py``). Outside autocast each block runs T5's own forward.

    :param model: a T5, changed in place.
    :rtype: int
    """
    from functools import partial

    from transformers.models.t5.modeling_t5 import T5DenseActDense, T5DenseGatedActDense

    blocks = [module for module in model.modules() if isinstance(module, (T5DenseActDense, T5DenseGatedActDense))]
    for block in blocks:
        block.forward = partial(_feed_forward_under_autocast, block, block.forward)  # type: ignore[method-assign]
    return len(blocks)


def _feed_forward_under_autocast(
    block: T5DenseActDense | T5DenseGatedActDense,
    t5_forward: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
) -> torch.Tensor:
    import torch
    from transformers.models.t5.modeling_t5 import T5DenseGatedActDense

    if not torch.is_autocast_enabled(hidden_states.device.type):
        return t5_forward(hidden_states)
    if isinstance(block, T5DenseGatedActDense):  # T5 v1.1, Flan-T5
        hidden_states = block.act(block.wi_0(hidden_states)) * block.wi_1(hidden_states)
    else:
        hidden_states = block.act(block.wi(hidden_states))
    return block.wo(block.dropout(hidden_states))


def share_attention_bias(model: T5ForConditionalGeneration) -> bool:
    """Let a T5 that runs SDPA attention build each stack's attention bias once a training step, not once a layer;
    return whether it now does.

    T5's layers share one position bias a stack, and one padding or causal mask. transformers' SDPA attention
    combines the two again in every layer, copies the sum out of the bias's (query, key, head) layout, and autocast
    casts it to bf16 before each attention: three passes over a (batch, heads, queries, keys) tensor in each of
    t5-small's 18 attentions, and each layer keeps its own copy for the backward. Here the first layer of a stack
    builds the bias in the attention's dtype and the others reuse it. The forward computes the same bits; the
    backward adds the layers' bias gradients in that dtype before casting them up, not after
    (``tests/test_model.py``). Evaluation, generation and compiled regions run transformers' own SDPA attention.

    :param model: a T5, changed in place; one whose attention is not SDPA (``eager``, ``flex_attention``) is left
        as it is.
    :rtype: bool
    """
    from functools import partial

    from torch.utils.weak import WeakIdKeyDictionary
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if model.config._attn_implementation != "sdpa":
        return False
    # Each stack's bias, under its position bias: an entry lives as long as the forward holds that position bias.
    AttentionInterface.register(SHARED_BIAS_ATTENTION, partial(_sdpa_with_shared_bias, WeakIdKeyDictionary()))
    AttentionMaskInterface.register(SHARED_BIAS_ATTENTION, sdpa_mask)  # the masks SDPA attention takes
    model.set_attn_implementation(SHARED_BIAS_ATTENTION)
    return True


def _sdpa_with_shared_bias(
    shared_biases: WeakIdKeyDictionary,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_bias: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    import torch
    from transformers.integrations.sdpa_attention import create_position_bias_mask, sdpa_attention_forward

    causal = (
        query.shape[2] > 1 and attention_mask is None and bool(module.is_causal if is_causal is None else is_causal)
    )
    # Only a training forward: a compiled region fuses the bias into its own kernels, and generation's cache makes a
    # causal attention's keys outnumber its queries, which transformers crops for.
    crops_keys = causal and key.shape[2] > query.shape[2]
    if position_bias is None or not module.training or torch.compiler.is_compiling() or crops_keys:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, position_bias=position_bias, is_causal=is_causal, **kwargs
        )
    shared = shared_biases.get(position_bias)
    if shared is None or shared[0] is not attention_mask or shared[1] != causal or shared[2].dtype != query.dtype:
        # Contiguous first, so the (batch, heads, queries, keys) sum is written in that order, which SDPA reads.
        bias = create_position_bias_mask(position_bias.contiguous(), attention_mask, causal, query, key)
        shared = (attention_mask, causal, bias.to(query.dtype))
        shared_biases[position_bias] = shared
    return sdpa_attention_forward(module, query, key, value, None, position_bias=shared[2], is_causal=False, **kwargs)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
