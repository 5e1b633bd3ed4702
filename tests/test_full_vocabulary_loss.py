"""The full-vocabulary training loss in slices (textsql.training.loss.full_vocabulary_loss): T5's own loss and
gradients without T5's logits, and T5's own forward where it cannot be computed so."""

import pytest
import torch
from helpers.dispatch import DispatchCount
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import T5Config, T5ForConditionalGeneration

from textsql.training.loss import LOSS_CHUNKS, TrainingLossT5, full_vocabulary_loss

VOCABULARY = 96
D_MODEL = 16
CHUNKED_OPERATOR = "torch_nn::_linear_cross_entropy_batch_chunked"


def tiny_model() -> TrainingLossT5:
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=VOCABULARY, d_model=D_MODEL, d_ff=32, d_kv=8, num_heads=2, num_layers=1, num_decoder_layers=1,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return TrainingLossT5(config).train()


def batch(questions: int, target_tokens: int = 9) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(2, VOCABULARY, (questions, 12), generator=generator)
    labels = torch.randint(2, VOCABULARY, (questions, target_tokens), generator=generator)
    labels[-1, -3:] = -100
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


class Operators(TorchDispatchMode):
    """The operators a step dispatches and the shapes of what they return (an operator's insides are its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: dict[str, list[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(func.name())
        self.dtypes[func.name()] = [arg.dtype for arg in args if isinstance(arg, torch.Tensor)]
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.shapes.append(tuple(tensor.shape))
        return out


def step(model: T5ForConditionalGeneration, inputs: dict, forward=None) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = (forward or type(model).forward)(model, **inputs).loss
    loss.backward()
    return loss.detach(), {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def test_in_slices_the_loss_and_every_gradient_are_t5s_own_and_no_logits_of_the_whole_batch_exist():
    model, inputs = tiny_model(), batch(questions=4)
    positions = inputs["labels"].numel()
    assert positions >= D_MODEL  # enough target positions to slice
    own_loss, own_gradients = step(model, inputs, forward=T5ForConditionalGeneration.forward)
    with Operators() as seen:
        loss, gradients = step(model, inputs)
    assert CHUNKED_OPERATOR in seen.names
    # T5's own step returns logits of every target position; this one none of them, nor a slice's (inside torch's
    # operator), nor any tensor as large.
    assert not [shape for shape in seen.shapes if shape and shape[-1] == VOCABULARY and len(shape) > 1]
    assert loss.item() == pytest.approx(own_loss.item(), rel=1e-6)
    assert gradients.keys() == own_gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, own_gradients[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_batch_is_cut_into_the_chosen_number_of_slices(monkeypatch):
    sizes = []
    real = torch.nn.functional.linear_cross_entropy

    def recording(*args, options=None, **kwargs):
        sizes.append(None if options is None else options.batch_chunk_size)
        return real(*args, options=options, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear_cross_entropy", recording)
    hidden, weight = torch.randn(4, 9, D_MODEL), torch.randn(VOCABULARY, D_MODEL)
    full_vocabulary_loss(hidden, weight, batch(questions=4)["labels"])
    # 36 target positions in LOSS_CHUNKS slices; under d_model positions, in one piece (no options: torch's
    # reference, the output layer then the cross-entropy, as transformers computes it).
    assert sizes == [-(-36 // LOSS_CHUNKS)]
    full_vocabulary_loss(hidden[:1, :8], weight, batch(questions=1, target_tokens=8)["labels"])
    assert sizes[1:] == [None]


def test_under_autocast_the_output_layer_runs_in_autocasts_precision_as_t5s_does():
    model, inputs = tiny_model(), batch(questions=4)
    with torch.autocast("cpu", dtype=torch.bfloat16), Operators() as seen:
        loss = model(**inputs).loss
    assert seen.dtypes[CHUNKED_OPERATOR][:2] == [torch.bfloat16, torch.bfloat16]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        own = T5ForConditionalGeneration.forward(model, **inputs).loss
    assert loss.item() == pytest.approx(own.item(), rel=1e-2)


@pytest.mark.parametrize("cause", ["ZeRO-3", "torch without linear_cross_entropy"])
def test_where_the_slices_cannot_be_computed_a_step_is_t5s_own_with_its_logits(monkeypatch, cause):
    model, inputs = tiny_model(), batch(questions=4)
    assert not model.full_logits and model.loss_vocabulary == "full"
    if cause == "ZeRO-3":
        # What DeepSpeed marks a partitioned parameter with; this loss never gathers it.
        monkeypatch.setattr(model.lm_head.weight, "ds_id", 0, raising=False)
    else:
        monkeypatch.delattr(torch.nn.functional, "linear_cross_entropy")
    assert model.full_logits and model.loss_vocabulary == "full"
    output = model(**inputs)
    assert output.logits.shape == (*inputs["labels"].shape, VOCABULARY)
    assert output.loss.item() == T5ForConditionalGeneration.forward(model, **inputs).loss.item()


# The operators that read a tensor's value back to the host (.item(), bool(), .all() in an if): each a host sync on a
# GPU.
HOST_READS = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::item")


@pytest.mark.parametrize("cause", [None, "torch without linear_cross_entropy"])
def test_a_padded_batch_trains_as_t5_does_without_reading_its_padding_back_to_the_host(monkeypatch, cause):
    """T5 given the 2D padding mask reads on the host whether any token is padding, for the encoder and for the
    cross-attention; a step given the mask ready-made reads nothing, and its loss and gradients are T5's own."""
    model, inputs = tiny_model(), batch(questions=4)
    inputs["attention_mask"][1, -5:] = 0  # one question is padded
    inputs["attention_mask"][3, -2:] = 0
    if cause:
        monkeypatch.delattr(torch.nn.functional, "linear_cross_entropy")
    with DispatchCount(*HOST_READS) as ours_read:
        loss, grads = step(model, inputs)
    with DispatchCount(*HOST_READS) as t5_read:
        t5_loss, t5_grads = step(model, inputs, T5ForConditionalGeneration.forward)
    assert (ours_read.count, t5_read.count) == (0, 2)
    assert loss.item() == pytest.approx(t5_loss.item(), rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, t5_grads[name], rtol=1e-5, atol=1e-7, msg=name)
