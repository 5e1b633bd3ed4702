import contextlib
import gc
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers.dispatch import DispatchCount
from torch.overrides import TorchFunctionMode
from transformers import T5ForConditionalGeneration
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.t5.modeling_t5 import T5LayerNorm

from textsql.errors import ModelError
from textsql.model import has_weights, load_model, load_tokenizer, resolve_model
from textsql.model.speedups import (
    SHARED_BIAS_ATTENTION,
    fuse_norms,
    fuse_projections,
    projection_groups,
    share_attention_bias,
    skip_feed_forward_upcast,
    speed_up_training,
)
from textsql.training.loss import training_model


def test_embedded_tokenizer_is_the_real_t5_vocabulary():
    tokenizer = load_tokenizer()
    assert tokenizer.is_fast
    assert len(tokenizer) == 32100
    ids = tokenizer("SELECT Notes FROM table").input_ids
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in ids


def test_embedded_model_is_small_and_deterministic():
    first, second = load_model(), load_model()
    assert 1e6 < first.num_parameters() < 2e7
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(next(load_model(seed=1).parameters()), next(first.parameters()))


def test_saved_model_round_trips(tmp_path: Path):
    model = load_model()
    model.save_pretrained(tmp_path)
    assert has_weights(tmp_path)
    reloaded = load_model(tmp_path)
    assert torch.equal(reloaded.shared.weight, model.shared.weight)


def test_missing_local_directory_names_the_flag(tmp_path: Path):
    with pytest.raises(ModelError, match="--model"):
        resolve_model(str(tmp_path / "nope"))


def test_unreadable_tokenizer_is_one_clear_error(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(ModelError, match="no tokenizer in"):
        load_tokenizer(tmp_path)


def _loss_and_gradients(
    model: torch.nn.Module, autocast: bool = False, padded: bool = False, train: bool = True
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(5, 32000, (4, 23), generator=generator)
    labels = torch.randint(5, 32000, (4, 11), generator=generator)
    batch = {"input_ids": inputs, "labels": labels}
    if padded:  # as a rank's batches come: sources padded, targets padded with the label pad
        batch["attention_mask"] = (torch.arange(23) < torch.tensor([[23], [17], [23], [9]])).long()
        labels[1:3, 8:] = -100
    torch.manual_seed(0)  # the same dropout masks in both models
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model.train(train)(**batch).loss
    loss.backward()
    return loss.detach(), {name: parameter.grad for name, parameter in model.named_parameters()}


class AttentionBiases(TorchFunctionMode):
    """The bias tensors handed to SDPA, each call's."""

    def __init__(self) -> None:
        super().__init__()
        self.biases: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.biases.append(kwargs["attn_mask"])
        return func(*args, **(kwargs or {}))

    def distinct(self) -> int:
        return len({id(bias) for bias in self.biases})


def _gated_t5() -> T5ForConditionalGeneration:
    """A small T5 v1.1 (Flan-T5's gated feed-forward), from a fixed seed."""
    torch.manual_seed(3)
    config = load_model().config.to_dict() | {"feed_forward_proj": "gated-gelu", "d_model": 32, "d_ff": 64}
    return T5ForConditionalGeneration(type(load_model().config).from_dict(config))


@pytest.mark.parametrize("autocast", [True, False])
@pytest.mark.parametrize("build", [load_model, _gated_t5], ids=["relu", "gated-gelu"])
def test_a_feed_forward_under_autocast_skips_the_two_casts_and_changes_no_bit(autocast, build):
    """T5's feed-forward casts its activation up to its output layer's fp32 weight, and autocast casts it straight
    back: the swapped blocks leave both out, forward and backward, to the same bits; outside autocast they are T5's."""
    reference, model = build(), build()
    blocks = skip_feed_forward_upcast(model)
    assert blocks == model.config.num_layers + model.config.num_decoder_layers
    with DispatchCount("aten::_to_copy") as t5_casts:
        expected_loss, expected_gradients = _loss_and_gradients(reference, autocast)
    with DispatchCount("aten::_to_copy") as casts:
        loss, gradients = _loss_and_gradients(model, autocast)
    assert t5_casts.count - casts.count == (4 * blocks if autocast else 0)
    assert torch.equal(loss, expected_loss)
    for name, gradient in gradients.items():
        assert torch.equal(gradient, expected_gradients[name]), name


def test_fused_norms_train_as_t5s_own_and_save_under_the_same_names(tmp_path: Path):
    reference, model = load_model(), load_model()
    config = model.config
    before = dict(model.named_parameters())
    assert fuse_norms(model) == (2 * config.num_layers + 1) + (3 * config.num_decoder_layers + 1)
    assert not any(isinstance(module, T5LayerNorm) for module in model.modules())
    # The optimizer is built afterwards from model.parameters(): the swapped norms must hold the same tensors.
    assert all(parameter is before[name] for name, parameter in model.named_parameters())
    assert model.state_dict().keys() == reference.state_dict().keys()
    expected_loss, expected_gradients = _loss_and_gradients(reference)
    loss, gradients = _loss_and_gradients(model)
    # On a CPU torch's RMSNorm runs T5's operators in T5's order: the same bits, so the demo learns as before.
    assert torch.equal(loss, expected_loss)
    for name, gradient in gradients.items():
        assert torch.equal(gradient, expected_gradients[name]), name
    model.save_pretrained(tmp_path)
    reloaded = T5ForConditionalGeneration.from_pretrained(tmp_path)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_a_fused_norm_in_bf16_rounds_as_t5s_own():
    # DeepSpeed's bf16 at ZeRO 1-3 casts the whole model: the norm's weight and input are bf16 there.
    t5_norm = T5LayerNorm(64, eps=1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(t5_norm.weight)
    holder = torch.nn.Sequential(t5_norm)
    fuse_norms(holder)
    hidden = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    fused = holder[0](hidden)
    assert fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused, t5_norm(hidden))


@pytest.mark.parametrize("autocast", [True, False])
def test_a_stack_builds_its_attention_bias_once_a_training_step_to_the_same_loss(autocast):
    """A rank's training step, with padding: SDPA gets one bias a stack's attention kind, the same for every layer,
    built and cast once; the loss and all but the position biases' gradients are the same bits, and theirs, added
    up in the attention's dtype, stay far closer to T5's own than bf16 itself is to fp32."""
    reference, model = training_model(None, "full"), training_model(None, "full")
    assert share_attention_bias(model)
    encoder, decoder = model.config.num_layers, model.config.num_decoder_layers
    with AttentionBiases() as t5_biases, DispatchCount("aten::_to_copy") as t5_casts:
        expected_loss, expected_gradients = _loss_and_gradients(reference, autocast, padded=True)
    with AttentionBiases() as biases, DispatchCount("aten::_to_copy") as casts:
        loss, gradients = _loss_and_gradients(model, autocast, padded=True)
    assert len(biases.biases) == t5_biases.distinct() == encoder + 2 * decoder
    assert biases.distinct() == 3  # the encoder's self-attention, the decoder's, the decoder's cross-attention
    # Under autocast each layer cast its bias down, and the gradient of the position-biased ones back up.
    assert t5_casts.count - casts.count == ((2 * (encoder - 1) + 3 * (decoder - 1)) if autocast else 0)
    assert torch.equal(loss, expected_loss)
    position_biases = {name for name in gradients if "relative_attention_bias" in name}
    assert len(position_biases) == 2
    for name, gradient in gradients.items():
        if name not in position_biases:
            assert torch.equal(gradient, expected_gradients[name]), name
    _, fp32_gradients = _loss_and_gradients(training_model(None, "full"), padded=True)
    for name in position_biases:
        ours = (gradients[name] - expected_gradients[name]).norm()
        if autocast:
            assert ours < (expected_gradients[name] - fp32_gradients[name]).norm() / 10, name
        else:
            torch.testing.assert_close(gradients[name], expected_gradients[name], rtol=1e-5, atol=1e-7)
    del loss, gradients
    gc.collect()
    assert not ALL_ATTENTION_FUNCTIONS[SHARED_BIAS_ATTENTION].args[0], "a bias outlived its step"


def test_with_a_shared_attention_bias_t5_generates_and_saves_as_before(tmp_path: Path):
    reference, model = load_model(), load_model()
    share_attention_bias(model)
    questions = torch.randint(5, 32000, (3, 9), generator=torch.Generator().manual_seed(2))
    expected = reference.eval().generate(questions, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.eval().generate(questions, max_new_tokens=6, do_sample=False), expected)
    model.save_pretrained(tmp_path)
    assert T5ForConditionalGeneration.from_pretrained(tmp_path).config._attn_implementation == "sdpa"


def test_a_t5_without_sdpa_attention_keeps_its_own():
    model = T5ForConditionalGeneration(load_model().config)
    model.set_attn_implementation("eager")
    assert not share_attention_bias(model)
    assert model.config._attn_implementation == "eager"


def _distance(gradients: dict[str, torch.Tensor], to: dict[str, torch.Tensor], names=None) -> float:
    return sum(((gradients[name] - to[name]) ** 2).sum() for name in names or gradients) ** 0.5


def _training_t5() -> T5ForConditionalGeneration:
    return training_model(None, "full")


@pytest.mark.parametrize("autocast", [True, False])
@pytest.mark.parametrize("build", [_training_t5, _gated_t5], ids=["relu", "gated-gelu"])
def test_layers_reading_one_input_run_as_one_product_to_t5s_loss(autocast, build):
    """A rank's training step, with padding: each self-attention's query, key and value layers run as one matrix
    product, all the decoder's cross-attention keys and values as another, and a gated feed-forward's two input
    layers as a third, forward and backward. The loss is T5's to float rounding; the gradients, whose input gradients
    add up inside one product instead of in separate casts and adds, are as close to fp32's as T5's own under
    autocast."""
    reference, model = build(), build()
    encoder, decoder = model.config.num_layers, model.config.num_decoder_layers
    gated = (encoder + decoder) * model.config.is_gated_act
    assert fuse_projections(model) == encoder + decoder + 1 + gated
    with DispatchCount("aten::mm", "aten::addmm") as t5_products:
        expected_loss, expected_gradients = _loss_and_gradients(reference, autocast, padded=True)
    with DispatchCount("aten::mm", "aten::addmm") as products:
        loss, gradients = _loss_and_gradients(model, autocast, padded=True)
    # Forward, two products fewer a self-attention, all but one of the cross-attentions' and one a gated
    # feed-forward; backward, twice that.
    assert t5_products.count - products.count == 3 * (2 * (encoder + decoder) + 2 * decoder - 1 + gated)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    if autocast:
        _, fp32_gradients = _loss_and_gradients(build(), padded=True)
        assert _distance(gradients, fp32_gradients) < 1.05 * _distance(expected_gradients, fp32_gradients)
        for name in gradients:
            t5s = _distance(expected_gradients, fp32_gradients, [name])
            assert _distance(gradients, fp32_gradients, [name]) < 1.5 * t5s + 1e-9, name
    else:
        for name in gradients:  # fp32: the sums in another order
            assert _distance(gradients, expected_gradients, [name]) <= 1e-5 * expected_gradients[name].norm(), name
    del loss, gradients
    gc.collect()
    assert all(not linear.forward.args[0].outputs for linear in model.modules() if hasattr(linear.forward, "args"))


@pytest.mark.parametrize(
    "optimizer",
    [partial(torch.optim.SGD, lr=1.0), partial(torch.optim.AdamW, lr=1e-3, fused=True)],
    ids=["SGD", "fused AdamW"],
)
def test_grouped_layers_project_again_after_their_weights_change(optimizer):
    """Encoder outputs passed in twice, an optimizer step between: the second forward projects them with the new
    weights, as T5 does, instead of handing back the first forward's outputs (fused AdamW changes the weights without
    counting a change in their version)."""
    reference, model = training_model(None, "full"), training_model(None, "full")
    fuse_projections(model)
    generator = torch.Generator().manual_seed(4)
    questions, labels = torch.randint(5, 32000, (2, 9), generator=generator), torch.randint(5, 32000, (2, 5))
    losses = []
    for t5 in (reference, model):
        t5.train().config.dropout_rate = 0.0
        for module in t5.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        encoded = t5.encoder(input_ids=questions)
        stepper = optimizer(t5.decoder.parameters())
        for _ in range(2):
            loss = t5(encoder_outputs=encoded, labels=labels).loss
            loss.backward(retain_graph=True)
            stepper.step()
            stepper.zero_grad()
            losses.append(loss.detach())
    torch.testing.assert_close(losses[2:], losses[:2], rtol=1e-5, atol=0)
    assert losses[1] < losses[0]


@pytest.mark.parametrize("way", ["activation checkpointing", "evaluation"])
def test_grouped_layers_run_as_t5s_own_where_a_product_would_not_fit(way):
    """Under gradient checkpointing a recomputed block would find its group's outputs already there; an evaluation
    (and generation, and ZeRO-3's partitioned weights, and compiled regions) calls each layer as T5 does."""
    reference, model = load_model(), load_model()
    fuse_projections(model)
    if way == "activation checkpointing":
        for t5 in (reference, model):
            t5.activation_checkpointing_enable()
    with DispatchCount("aten::mm", "aten::addmm") as t5_products:
        expected_loss, expected_gradients = _loss_and_gradients(reference, train=way != "evaluation")
    with DispatchCount("aten::mm", "aten::addmm") as products:
        loss, gradients = _loss_and_gradients(model, train=way != "evaluation")
    assert products.count == t5_products.count
    assert torch.equal(loss, expected_loss)
    for name, gradient in gradients.items():
        assert torch.equal(gradient, expected_gradients[name]), name


def test_a_ranks_t5_trains_under_activation_checkpointing_as_t5():
    """All of a rank's changes, with `--gradient_checkpointing`: the recomputed blocks record what their forward did
    (the shared bias is reused alike both times), and the step is T5's."""
    reference, model = _training_t5(), _training_t5()
    assert all(speed_up_training(model).values())
    for t5 in (reference, model):
        t5.activation_checkpointing_enable()
    expected_loss, expected_gradients = _loss_and_gradients(reference, padded=True)
    loss, gradients = _loss_and_gradients(model, padded=True)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    for name in gradients:
        assert _distance(gradients, expected_gradients, [name]) <= 1e-5 * expected_gradients[name].norm(), name


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_under_activation_checkpointing_the_weight_copies_stay_off(reentrant):
    """bf16 autocast with `--gradient_checkpointing`: the backward recomputes each block after the forward ended, so
    the layers compute from their fp32 weights as T5's do, the same bits as a rank's T5 without the copies."""
    reference, model = _all_but_weight_copies(_training_t5()), _training_t5()
    speed_up_training(model)
    for t5 in (reference, model):
        t5.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    expected_loss, expected_gradients = _loss_and_gradients(reference, autocast=True, padded=True)
    loss, gradients = _loss_and_gradients(model, autocast=True, padded=True)
    assert torch.equal(loss, expected_loss)
    for name, gradient in gradients.items():
        assert torch.equal(gradient, expected_gradients[name]), name


def _all_but_weight_copies(model: T5ForConditionalGeneration) -> T5ForConditionalGeneration:
    for change in (fuse_norms, skip_feed_forward_upcast, share_attention_bias, fuse_projections):
        change(model)
    return model


def _training_steps(model: T5ForConditionalGeneration, fused: bool, *counts: DispatchCount) -> tuple[list, list, dict]:
    """Three optimizer steps of two micro-batches each under bf16 autocast, the third step's operators counted:
    the losses, each step's gradients, the weights after. ``fused``: torch's fused AdamW (a rank's default), whose
    step changes the weights without counting a change in their version, else its loop over the tensors."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=False)
    losses, gradients = [], []
    for step in range(3):
        for micro_batch in range(2):
            generator = torch.Generator().manual_seed(micro_batch)
            batch = {"input_ids": torch.randint(5, 32000, (4, 23), generator=generator)}
            batch["labels"] = torch.randint(5, 32000, (4, 11), generator=generator)
            torch.manual_seed(10 * step + micro_batch)  # the same dropout masks in both models
            with contextlib.ExitStack() as counting:
                for count in counts if step == 2 else ():
                    counting.enter_context(count)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model.train()(**batch).loss
                loss.backward()
            losses.append(loss.detach())
        gradients.append({name: parameter.grad.clone() for name, parameter in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, gradients, {name: parameter.detach().clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("fused", [True, False], ids=["fused AdamW", "AdamW"])
@pytest.mark.parametrize("build", [_training_t5, _gated_t5], ids=["relu", "gated-gelu"])
def test_linear_layers_compute_from_bf16_copies_made_at_each_forward_to_the_same_bits(build, fused):
    """A rank's steps under bf16 autocast, with an optimizer and two micro-batches a step: each linear layer (or
    group run as one product) computes from a bf16 copy of its weights made at each forward, instead of casting its
    fp32 weight forward and the weight's gradient backward. The losses, every step's fp32 gradients (accumulated
    over the micro-batches in fp32) and the weights the optimizer leaves are the same bits."""
    reference, model = _all_but_weight_copies(build()), build()
    speed_up_training(model)
    groups = len([module for module in model.modules() if isinstance(module, torch.nn.Linear)]) - 1  # but lm_head
    groups -= sum(len(linears) - 1 for linears, _ in projection_groups(model))
    t5_casts, casts, multi_tensor_copies = (
        DispatchCount(name) for name in ["aten::_to_copy"] * 2 + ["aten::_foreach_copy_"]
    )
    expected = _training_steps(reference, fused, t5_casts)
    losses, gradients, weights = _training_steps(model, fused, casts, multi_tensor_copies)
    assert all(torch.equal(loss, other) for loss, other in zip(losses, expected[0])), (losses, expected[0])
    for step, step_gradients in enumerate(gradients):
        for name, gradient in step_gradients.items():
            assert torch.equal(gradient, expected[1][step][name]), (step, name)
    for name, weight in weights.items():
        assert torch.equal(weight, expected[2][name]), name
    assert set(model.state_dict()) == set(reference.state_dict())
    # One cast forward and one backward a group a micro-batch, for none; one copy of the weights and one of the
    # gradients a micro-batch.
    assert t5_casts.count - casts.count == 2 * 2 * groups
    assert multi_tensor_copies.count == 2 + 2


def test_with_weight_copies_evaluation_and_generation_compute_as_t5(tmp_path: Path):
    """After a training step, an evaluation (with or without autocast) and generation use the fp32 weights as T5
    does, never a copy: the same bits as a T5 without the copies."""
    reference, model = _all_but_weight_copies(_training_t5()), _training_t5()
    speed_up_training(model)
    for t5 in (reference, model):
        _training_steps(t5, fused=True)
    questions = torch.randint(5, 32000, (3, 9), generator=torch.Generator().manual_seed(2))
    expected = reference.eval().generate(questions, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.eval().generate(questions, max_new_tokens=6, do_sample=False), expected)
    for autocast in (True, False):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = [t5.eval()(input_ids=questions, labels=questions).logits for t5 in (reference, model)]
        assert torch.equal(*logits)
