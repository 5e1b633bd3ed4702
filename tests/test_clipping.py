"""Clipping by the global norm: the same update as torch's clip_grad_norm_, in ops that do not grow with the tensors."""

import pytest
import torch

from bench.steps import count_ops
from textsql.training.clipping import clip_before_each_step, clip_grad_norm

T5_SMALL_TENSORS = 131


def parameters_with_grads(count: int, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    parameters = []
    for index in range(count):
        parameter = torch.nn.Parameter(torch.randn(3 + index % 5, 4, generator=generator))
        parameter.grad = torch.randn(parameter.shape, generator=generator)
        parameters.append(parameter)
    return parameters


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_the_norm_and_the_clipped_gradients_equal_torchs(max_norm):
    ours, reference = parameters_with_grads(20), parameters_with_grads(20)
    norm = clip_grad_norm(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm)
    torch.testing.assert_close(norm, expected)
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_a_fused_adamw_step_with_the_pre_hook_equals_clipping_then_stepping():
    ours, reference = parameters_with_grads(30), parameters_with_grads(30)
    optimizer = torch.optim.AdamW(ours, lr=0.1, fused=True)
    clip_before_each_step(optimizer, 0.3)
    expected = torch.optim.AdamW(reference, lr=0.1)
    for _ in range(2):
        optimizer.step()
        torch.nn.utils.clip_grad_norm_(reference, 0.3)
        expected.step()
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs)
    # The step changed something, so the comparison above compared updates, not initial values.
    assert not torch.equal(ours[0], parameters_with_grads(30)[0])


def test_gradients_of_two_dtypes_fall_back_to_torchs_clipping():
    parameters = parameters_with_grads(4)
    parameters[0].data, parameters[0].grad = parameters[0].data.double(), parameters[0].grad.double()
    reference = [torch.nn.Parameter(p.detach().clone()) for p in parameters]
    for copy, original in zip(reference, parameters):
        copy.grad = original.grad.clone()
    torch.testing.assert_close(
        clip_grad_norm(parameters, 0.1), torch.nn.utils.clip_grad_norm_(reference, 0.1), check_dtype=False
    )


def ops_of(clip, count: int) -> int:
    parameters = parameters_with_grads(count)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        clip(parameters)
    return count_ops(profiler.events())["ops"]


def test_clipping_takes_the_same_few_ops_for_t5_smalls_131_tensors_as_for_3():
    ours = ops_of(lambda p: clip_grad_norm(p, 1.0), T5_SMALL_TENSORS)
    assert ours == ops_of(lambda p: clip_grad_norm(p, 1.0), 3) <= 8
    # torch's own foreach clipping moves each tensor's norm to the first device: one op per tensor.
    torch_ops = ops_of(lambda p: torch.nn.utils.clip_grad_norm_(p, 1.0, foreach=True), T5_SMALL_TENSORS)
    assert torch_ops > T5_SMALL_TENSORS
