"""bf16 copies of a T5's linear weights, made at each of its training forwards under bf16 autocast.

Under autocast a linear layer casts its fp32 weight to bf16 every time it is called, and its backward casts the
weight's gradient back to fp32: two kernels a layer a micro-batch, about 120 in t5-small's and 290 in t5-base's,
each with its own autograd node on the host, which the GPU waits on. :class:`WeightCopies` keeps the weights as bf16
tensors beside the fp32 ones (the optimizer's and the checkpoint's, untouched): all brought up to date with one
multi-tensor copy at their first use in a forward, and the layers' bf16 gradients handed to the fp32 weights with one
multi-tensor copy at the end of each backward, added in fp32 when a gradient is already there (accumulation over
micro-batches). The layers compute the same bits as under autocast, and the fp32 weights receive the same gradients
(``tests/test_model.py``).

At each forward, not only when the weights changed: nothing says reliably that they did. torch's fused AdamW (a
rank's default) and writes through ``.data`` change a weight without counting a change in its version, so copies kept
until a weight's version moved would compute a whole run from its first step's weights.

Only while the model's own forward runs in training mode, with gradients, under bf16 autocast, on fp32 weights that
ZeRO-3 has not partitioned and without activation checkpointing; otherwise, and in compiled regions, each layer is
called as T5 calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import torch
from transformers import T5ForConditionalGeneration


class WeightCopies:
    """The bf16 copies of groups of linear layers' weights: one tensor a group, its layers' weights stacked (the
    layers that :func:`textsql.model.speedups.fuse_projections` runs as one product read it whole)."""

    def __init__(self, groups: Sequence[Sequence[torch.nn.Linear]], blocks: Sequence[torch.nn.Module] = ()) -> None:
        """
        :param groups: the layers, a group per copy.
        :param blocks: the blocks activation checkpointing would recompute (their ``gradient_checkpointing``).
        """
        self.groups = [list(group) for group in groups]
        self.blocks = list(blocks)
        self.rows = [[linear.out_features for linear in group] for group in self.groups]
        # Whether the model's forward now running may use the copies (:meth:`begin`).
        self.on = False
        self._copies: list[torch.Tensor] = []
        self._pieces: list[torch.Tensor] = []  # each layer's rows of its group's copy
        self._pending: list[torch.Tensor] | None = None  # the fp32 weights this forward has yet to copy
        self._returning = False

    def weight(self, group: int) -> torch.Tensor | None:
        """The group's bf16 copy while the model's forward may use it; None otherwise.

        :rtype: torch.Tensor | None
        """
        if not self.on or torch.compiler.is_compiling():
            return None
        if self._pending is not None:  # here, not in begin(): a model whose layers all run compiled makes none
            self._refresh(self._pending)
            self._pending = None
        return self._copies[group]

    def weights(self) -> list[torch.Tensor]:
        """The fp32 weights, group by group.

        :rtype: list[torch.Tensor]
        """
        return [linear.weight for group in self.groups for linear in group]

    def begin(self, model: torch.nn.Module, *_: Any) -> None:
        """The model's forward pre-hook: whether its forward may use the copies (brought up to date at first use)."""
        weights = self.weights()
        device = weights[0].device.type
        self.on = (
            model.training
            and torch.is_grad_enabled()
            and torch.is_autocast_enabled(device)
            and torch.get_autocast_dtype(device) == torch.bfloat16
            and all(weight.dtype == torch.float32 and not hasattr(weight, "ds_id") for weight in weights)
            # What transformers' is_activation_checkpointing asks, of the blocks alone: it walks every module.
            and not any(getattr(block, "gradient_checkpointing", False) for block in self.blocks)
        )
        self._pending = weights if self.on else None

    def end(self, *_: Any) -> None:
        """The model's forward hook: the forward is over (an evaluation or generation may call parts of it next)."""
        self.on = False

    def _refresh(self, weights: list[torch.Tensor]) -> None:
        if not self._copies or self._copies[0].device != weights[0].device:
            self._allocate(weights[0].device)
        with torch.no_grad():
            torch._foreach_copy_(self._pieces, weights)

    def _allocate(self, device: torch.device) -> None:
        self._copies, self._pieces = [], []
        for group, rows in zip(self.groups, self.rows):
            copy = torch.empty((sum(rows), group[0].in_features), dtype=torch.bfloat16, device=device)
            copy.requires_grad_(True)
            copy.register_post_accumulate_grad_hook(self._return_after_backward)
            self._copies.append(copy)
            self._pieces += copy.detach().split(rows)

    def _return_after_backward(self, _copy: torch.Tensor) -> None:
        if not self._returning:
            self._returning = True
            torch.autograd.Variable._execution_engine.queue_callback(self._return_gradients)

    def _return_gradients(self) -> None:
        """Hand the copies' gradients to the fp32 weights: one multi-tensor copy, and one add where there were some."""
        self._returning = False
        done = [index for index, copy in enumerate(self._copies) if copy.grad is not None]
        fp32 = [torch.empty_like(self._copies[index], dtype=torch.float32) for index in done]
        torch._foreach_copy_(fp32, [cast(torch.Tensor, self._copies[index].grad) for index in done])
        added_to, added = [], []
        for index, gradient in zip(done, fp32):
            self._copies[index].grad = None
            for linear, rows in zip(self.groups[index], gradient.split(self.rows[index])):
                if linear.weight.grad is None:
                    linear.weight.grad = rows
                else:
                    added_to.append(linear.weight.grad)
                    added.append(rows)
        if added:
            torch._foreach_add_(added_to, added)


def copy_weights_at_each_forward(
    model: T5ForConditionalGeneration, groups: Sequence[Sequence[torch.nn.Linear]]
) -> WeightCopies:
    """Give a T5's linear layers bf16 copies of their weights, made at each training forward (see the module's
    text): ``groups`` share one copy a group (layers run as one product), every other linear layer of its stacks
    (T5's have no bias) has one of its own.
    The grouped layers' own forward must ask :meth:`WeightCopies.weight` for it; the others are changed here.

    :param model: a T5, changed in place.
    :param groups: the layers that are run as one product.
    :rtype: WeightCopies
    """
    grouped = {id(linear) for group in groups for linear in group}
    alone = [
        cast(torch.nn.Linear, module)
        for stack in (model.encoder, model.decoder)
        for module in cast(torch.nn.Module, stack).modules()
        if isinstance(module, torch.nn.Linear) and module.bias is None and id(module) not in grouped
    ]
    blocks = [block for stack in (model.encoder, model.decoder) for block in stack.block]
    copies = WeightCopies([*groups, *[[linear] for linear in alone]], blocks)
    for index, linear in enumerate(alone, start=len(groups)):
        linear.forward = partial(_from_copy, copies, index, linear.forward)  # type: ignore[method-assign]
    model.register_forward_pre_hook(copies.begin)
    model.register_forward_hook(copies.end, always_call=True)
    return copies


def _from_copy(
    copies: WeightCopies,
    group: int,
    linear_forward: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
) -> torch.Tensor:
    weight = copies.weight(group)
    return linear_forward(hidden_states) if weight is None else torch.nn.functional.linear(hidden_states, weight)
