"""Evaluation generation bounded by the gold queries: one length, saved with the model, no warnings."""

import json
import logging

import datasets
import pytest
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments
from transformers.utils import logging as hf_logging

from textsql.constants import LABEL_PAD_TOKEN_ID
from textsql.decoding.bounds import GENERATION_MARGIN, KeepGenerationBound, bound_generation, longest_label
from textsql.model import load_model, load_tokenizer


def labelled(lengths: list[int]) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {
            "input_ids": [[5, 6, 7, 1]] * len(lengths),
            "attention_mask": [[1] * 4] * len(lengths),
            "labels": [[9] * (length - 1) + [1] for length in lengths],
        }
    )


def arguments(tmp_path, cap: int | None = 64) -> Seq2SeqTrainingArguments:
    return Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        predict_with_generate=True,
        generation_max_length=cap,
        report_to=[],
        use_cpu=True,
        per_device_eval_batch_size=4,
        disable_tqdm=True,
    )


def test_the_bound_is_the_longest_gold_query_plus_the_margin(tmp_path):
    model, args = load_model(), arguments(tmp_path)
    assert longest_label(labelled([5, 12, 7])) == 12
    assert bound_generation(model, args, labelled([5, 12, 7])) == 12 + GENERATION_MARGIN
    assert model.generation_config.max_new_tokens == 12 + GENERATION_MARGIN
    assert model.generation_config.max_length is None and args.generation_max_length is None


def test_generation_max_length_caps_it_and_stands_in_without_labels(tmp_path):
    assert bound_generation(load_model(), arguments(tmp_path, cap=10), labelled([30])) == 10
    assert bound_generation(load_model(), arguments(tmp_path, cap=40), None) == 40


@pytest.fixture
def hf_warnings(caplog):
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            yield caplog
    finally:
        hf_logging.disable_propagation()


def test_evaluation_warns_nothing_and_the_saved_config_has_the_bound(tmp_path, hf_warnings):
    tokenizer, model = load_tokenizer(), load_model()
    model.accepts_loss_kwargs = False
    data = labelled([6, 11, 9, 4])
    args = arguments(tmp_path)
    bound = bound_generation(model, args, data)
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=LABEL_PAD_TOKEN_ID),
        callbacks=[KeepGenerationBound()],
    )
    trainer.predict(data)  # a second evaluation must not inherit the first one's filled-in defaults
    output = trainer.predict(data)
    # An untrained model never writes </s>: it runs to the bound, not to 64 or 128.
    assert output.predictions.shape[1] <= bound + 1
    trainer.save_model(str(tmp_path / "model"))
    saved = json.loads((tmp_path / "model" / "generation_config.json").read_text())
    assert saved["max_new_tokens"] == bound and "max_length" not in saved
    reloaded = load_model(str(tmp_path / "model"))
    reloaded.generate(input_ids=trainer.data_collator([dict(data[0])])["input_ids"])
    assert not [record.getMessage() for record in hf_warnings.records if "max_length" in record.getMessage()]
