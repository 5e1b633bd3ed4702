"""Changes to a loaded T5 that make its steps cheaper and leave what it computes as T5's.

Each changes the model in place and keeps every weight under its name, so checkpoints and ``model/`` load into
``T5ForConditionalGeneration`` as before. A rank applies them all (:func:`speed_up_training`); the predictor fuses
the norms. ``tests/test_model.py`` holds each to T5's own loss and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface, AttentionMaskInterface, T5ForConditionalGeneration
from transformers.integrations.sdpa_attention import create_position_bias_mask, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask
from transformers.models.t5.modeling_t5 import (
    T5DenseActDense,
    T5DenseGatedActDense,
    T5LayerCrossAttention,
    T5LayerNorm,
    T5LayerSelfAttention,
)

from textsql.model.weight_copies import WeightCopies, copy_weights_at_each_forward

# The name transformers' attention registry knows the training step's SDPA attention by (share_attention_bias).
SHARED_BIAS_ATTENTION = "sdpa_shared_bias"


def speed_up_training(model: T5ForConditionalGeneration) -> dict[str, int]:
    """Apply every change below to a T5 a rank trains; return how many parts each changed.

    :rtype: dict
    """
    copies = copy_weights_at_each_forward(model, [linears for linears, _ in projection_groups(model)])
    return {
        "norms fused": fuse_norms(model),
        "feed-forward blocks without the fp32 round trip": skip_feed_forward_upcast(model),
        "stacks sharing one attention bias": 2 * share_attention_bias(model),
        "projection groups computed as one": fuse_projections(model, copies),
        "linear layers computing from bf16 weight copies": len(copies.weights()),
    }


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
    blocks = [module for module in model.modules() if isinstance(module, (T5DenseActDense, T5DenseGatedActDense))]
    for block in blocks:
        block.forward = partial(_feed_forward_under_autocast, block, block.forward)  # type: ignore[method-assign]
    return len(blocks)


def _feed_forward_under_autocast(
    block: T5DenseActDense | T5DenseGatedActDense,
    t5_forward: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
) -> torch.Tensor:
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


@dataclass
class _ProjectionGroup:
    """Linear layers that read the same input in a step, and their outputs for each input the current forward read."""

    linears: list[torch.nn.Linear]
    blocks: list[torch.nn.Module]  # the T5 blocks they sit in, which gradient checkpointing recomputes
    copies: WeightCopies | None = None  # made for projection_groups' groups, this one among them
    copy: int = -1  # this group's among them
    outputs: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # by input, in the model's forward


def fuse_projections(model: T5ForConditionalGeneration, copies: WeightCopies | None = None) -> int:
    """Let the linear layers of a T5 that read the same input compute their outputs as one, in a training step;
    return how many groups.

    Each self-attention's query, key and value layers read one input, every cross-attention's key and value layers
    read the encoder's output (12 layers over t5-small's decoder), and a gated feed-forward's (T5 v1.1, Flan-T5) two
    input layers read one input. T5 calls each on its own, so under autocast each casts the input and its weight to
    bf16 and casts both gradients back, and each runs two small matrix products backward. A group runs one product
    on its weights stacked, splits the output, and adds the input's gradients in that product's own accumulator, not
    in separate casts and adds. The loss and gradients are T5's to float rounding, as close to fp32's as T5's own
    under autocast (``tests/test_model.py``). Evaluation, generation, compiled regions, activation checkpointing and
    ZeRO-3's partitioned weights call each layer as T5 does.

    :param model: a T5, changed in place.
    :param copies: bf16 copies of the weights made for :func:`projection_groups` (a group's stacked weights, ready).
    :rtype: int
    """
    groups = [
        _ProjectionGroup(linears, blocks, copies, copies.groups.index(linears) if copies else -1)
        for linears, blocks in projection_groups(model)
    ]
    for group in groups:
        for index, linear in enumerate(group.linears):
            linear.forward = partial(_grouped_projection, group, index, linear.forward)  # type: ignore[method-assign]
    model.register_forward_pre_hook(partial(_forget_outputs, groups))
    return len(groups)


def _forget_outputs(groups: list[_ProjectionGroup], *_: Any) -> None:
    # A group's outputs hold for the forward that computed them: an input read again in another forward (encoder
    # outputs passed in twice) is projected again with the weights as they are then. Nothing cheaper tells whether
    # the weights changed in between: torch's fused AdamW changes them without counting a change in their version.
    for group in groups:
        group.outputs.clear()


def projection_groups(model: T5ForConditionalGeneration) -> list[tuple[list[torch.nn.Linear], list[torch.nn.Module]]]:
    """The linear layers of a T5 that read the same input (see :func:`fuse_projections`), group by group, each with
    the blocks they sit in.

    :rtype: list[tuple[list[torch.nn.Linear], list[torch.nn.Module]]]
    """
    groups = []
    for stack in (model.encoder, model.decoder):
        keys_and_values: list[torch.nn.Linear] = []
        blocks = list(stack.block)
        for block in blocks:
            for layer in cast("torch.nn.ModuleList", block.layer):
                if isinstance(layer, T5LayerSelfAttention):
                    attention = layer.SelfAttention
                    groups.append(([attention.q, attention.k, attention.v], [block]))
                elif isinstance(layer, T5LayerCrossAttention):
                    keys_and_values += [layer.EncDecAttention.k, layer.EncDecAttention.v]
                elif isinstance(feed_forward := getattr(layer, "DenseReluDense", None), T5DenseGatedActDense):
                    groups.append(([feed_forward.wi_0, feed_forward.wi_1], [block]))
        if keys_and_values:
            groups.append((keys_and_values, blocks))
    return groups


def _grouped_projection(
    group: _ProjectionGroup,
    index: int,
    linear_forward: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
) -> torch.Tensor:
    linears = group.linears
    if (
        not linears[index].training
        or torch.compiler.is_compiling()  # a compiled region fuses what it can itself
        # A recomputed block would find its group's outputs already there and record fewer ops than its forward.
        or any(getattr(block, "gradient_checkpointing", False) for block in group.blocks)
        or any(hasattr(linear.weight, "ds_id") for linear in linears)  # ZeRO-3 gathers a layer's weight for its call
    ):
        return linear_forward(hidden_states)
    computed = group.outputs.get(hidden_states)
    if computed is None:
        copy = group.copies.weight(group.copy) if group.copies else None
        weight = torch.cat([linear.weight for linear in linears]) if copy is None else copy
        computed = torch.nn.functional.linear(hidden_states, weight).split(
            [linear.out_features for linear in linears], dim=-1
        )
        group.outputs[hidden_states] = computed
    return computed[index]
