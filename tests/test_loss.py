"""T5's training loss without its full logits (textsql.training.loss): over the whole vocabulary in slices, and over
the batch's own tokens."""

import json

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from textsql.model import load_model
from textsql.training.loss import (
    TrainingLossT5,
    batch_vocabulary_loss,
    resolve_loss_vocabulary,
    training_model,
)

VOCABULARY = 48


def tiny_config() -> T5Config:
    return T5Config(
        vocab_size=VOCABULARY, d_model=16, d_ff=32, d_kv=8, num_heads=2, num_layers=1, num_decoder_layers=1,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip


def batch(covering: bool) -> dict[str, torch.Tensor]:
    """Two questions and their targets; ``covering``: their tokens are the whole vocabulary."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(2, VOCABULARY, (2, 60), generator=generator)
    if covering:
        input_ids[0, : VOCABULARY - 2] = torch.arange(2, VOCABULARY)
    input_ids[1, -3:] = 0
    labels = torch.randint(2, VOCABULARY, (2, 9), generator=generator)
    labels[1, -2:] = -100
    return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), "labels": labels}


def batch_model(config: T5Config | None = None) -> TrainingLossT5:
    model = TrainingLossT5(config or tiny_config())
    model.vocabulary = "batch"
    return model


def test_over_a_batch_covering_the_whole_vocabulary_it_is_t5s_own_loss():
    torch.manual_seed(0)
    model = batch_model().train()
    inputs = batch(covering=True)
    inputs["input_ids"][0, -1] = 1  # EOS and pad are in the batch as well: every token is
    ours = model(**inputs).loss
    full = T5ForConditionalGeneration.forward(model, **inputs).loss
    assert ours.item() == pytest.approx(full.item(), rel=1e-5)


def test_over_part_of_the_vocabulary_the_softmax_leaves_the_other_tokens_out():
    torch.manual_seed(0)
    model = batch_model().train()
    inputs = batch(covering=False)
    present = torch.unique(torch.cat([inputs["input_ids"].flatten(), inputs["labels"][inputs["labels"] >= 0]]))
    assert len(present) < VOCABULARY
    logits = T5ForConditionalGeneration.forward(model, **inputs).logits
    kept = inputs["labels"] >= 0
    expected = torch.nn.functional.cross_entropy(
        logits[..., present][kept], torch.searchsorted(present, inputs["labels"][kept])
    )
    assert model(**inputs).loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert model(**inputs).loss.item() < T5ForConditionalGeneration.forward(model, **inputs).loss.item()


def test_a_target_shifted_by_one_token_changes_the_loss():
    hidden, weight = torch.randn(1, 4, 8), torch.randn(20, 8)
    labels, input_ids = torch.tensor([[5, 6, 7, 1]]), torch.tensor([[5, 6, 7, 9, 1]])
    assert batch_vocabulary_loss(hidden, weight, labels, input_ids) != batch_vocabulary_loss(
        hidden, weight, labels.roll(1, dims=1), input_ids
    )


def test_in_evaluation_it_is_t5_with_full_logits(tmp_path):
    torch.manual_seed(0)
    model = batch_model().eval()
    inputs = batch(covering=False)
    output = model(**inputs)
    assert output.logits.shape[-1] == VOCABULARY
    model.save_pretrained(tmp_path)
    loaded = T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded(**inputs).logits, output.logits)
    # The saved config names T5's class, which the Hub and serving engines know, not the training loss's.
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["T5ForConditionalGeneration"]


def test_auto_trains_a_model_from_scratch_over_the_batch_and_one_with_weights_over_everything(tmp_path):
    assert resolve_loss_vocabulary("auto", "default") == "batch"
    assert resolve_loss_vocabulary("auto", "t5-small") == "full"
    load_model().save_pretrained(tmp_path)
    assert resolve_loss_vocabulary("auto", str(tmp_path)) == "full"
    assert resolve_loss_vocabulary("full", "default") == "full"
    built = training_model(None, "batch")
    assert type(built) is TrainingLossT5 and built.loss_vocabulary == "batch" and not built.full_logits
