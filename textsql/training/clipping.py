"""Gradient clipping by the global norm in a fixed handful of ops, whatever the number of tensors.

``torch.nn.utils.clip_grad_norm_(foreach=True)`` computes the per-tensor norms in one foreach op, but then
moves each norm to the first tensor's device (``norm.to(first_device)``), one dispatched op per tensor
(131 for t5-small) even when all share a device. Here the gradients of one device and dtype (what a rank's
trainer optimizer holds under torch autocast: fp32 weights on one accelerator) go through eight ops:
foreach norm, stack, norm, add, reciprocal and mul (the division), clamp, foreach mul. Like torch's own,
it never reads the norm on the host (the scale is clamped to 1 instead of branching): no host sync.

Usage::

    >>> weight = torch.nn.Parameter(torch.ones(4))
    >>> weight.grad = torch.full((4,), 3.0)
    >>> float(clip_grad_norm([weight], 1.0))
    6.0
    >>> [round(value, 3) for value in weight.grad.tolist()]
    [0.5, 0.5, 0.5, 0.5]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

EPSILON = 1e-6  # torch's clip_grad_norm_ adds the same to the norm before dividing


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so their global 2-norm is at most ``max_norm``; the norm
    before clipping, as ``torch.nn.utils.clip_grad_norm_`` computes it.

    Gradients of several devices or dtypes go through torch's own clipping, which groups them.

    :rtype: torch.Tensor
    """
    parameters = list(parameters)
    grads = [parameter.grad for parameter in parameters if parameter.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    if len({(grad.device, grad.dtype) for grad in grads}) > 1:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    # torch._foreach_norm is what clip_grad_norm_ itself calls: one op for all tensors.
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + EPSILON), max=1.0))
    return total


class ClipBeforeStep:
    """The optimizer step pre-hook that clips: it keeps the last norm it computed, on the device, unread.

    :param parameters: the optimizer's parameters.
    :param max_norm: the norm their gradients are clipped to.
    """

    def __init__(self, parameters: list[torch.Tensor], max_norm: float) -> None:
        self.parameters, self.max_norm = parameters, max_norm
        # The gradients' norm before the last step's clipping (a tensor: reading it is the caller's host sync).
        self.norm: torch.Tensor | None = None

    def __call__(self, *_: Any) -> None:
        self.norm = clip_grad_norm(self.parameters, self.max_norm)


def clip_before_each_step(optimizer: torch.optim.Optimizer, max_norm: float) -> ClipBeforeStep:
    """Make ``optimizer`` clip its parameters' gradients to ``max_norm`` right before each of its steps.

    :returns: the hook, whose ``norm`` is the last step's gradient norm before clipping.
    :rtype: ClipBeforeStep
    """
    hook = ClipBeforeStep([parameter for group in optimizer.param_groups for parameter in group["params"]], max_norm)
    optimizer.register_step_pre_hook(hook)
    return hook
