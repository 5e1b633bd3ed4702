"""Training teaches the model something: the embedded small T5, trained briefly on synthetic questions, picks the
select column of questions about tables it has never seen far more often than "always the first column".

It is meant to fail when training teaches nothing (labels shifted by a token, another table's header fed to the
model), which no other test notices. Skipped until the model learns within its budget.

The training runs in this process, without DeepSpeed, on the rank program's data and model code: the dataset
``textsql prepare`` writes, :func:`textsql.model.load_model`, the rank program's collator, and AdamW with a
linear decay as the trainer builds it; the held-out questions are answered by :func:`textsql.inference.predict.predict`
with grammar-constrained decoding and scored by :func:`textsql.inference.evaluate.evaluate`.
"""

import datasets
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorForSeq2Seq, get_linear_schedule_with_warmup, set_seed

from textsql.constants import LABEL_PAD_TOKEN_ID
from textsql.data.prepare import prepare
from textsql.inference.predict import GenerationOptions, Predictor, predict
from textsql.model import load_model, load_tokenizer

SEED = 0
TRAIN_QUESTIONS = 6000
HELD_OUT_QUESTIONS = 100
STEPS = 300
BATCH_SIZE = 32
LEARNING_RATE = 3e-3
# How far above the trivial baseline (the first column) held-out select-column accuracy must be.
MARGIN = 0.3


@pytest.mark.slow
@pytest.mark.skip(
    reason="issue 28: the small T5 from random weights does not yet learn to copy a column in a short run "
    "(300 demo steps: held-out select 17.5 % against the first column's 15.0 %), nor does this run finish in 3 minutes here"
)
def test_short_training_on_synthetic_questions_learns_to_pick_the_select_column(tmp_path):
    data_dir = tmp_path / "data"
    prepare(source="synthetic", out=str(data_dir), limit=TRAIN_QUESTIONS)
    set_seed(SEED)
    tokenizer, model = load_tokenizer(None), load_model(None)
    train = datasets.load_from_disk(str(data_dir))["train"].select_columns(["input_ids", "attention_mask", "labels"])
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=LABEL_PAD_TOKEN_ID)
    batches = DataLoader(
        train,
        batch_size=BATCH_SIZE,
        shuffle=True,
        collate_fn=collator,
        generator=torch.Generator().manual_seed(SEED),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    schedule = get_linear_schedule_with_warmup(optimizer, 0, STEPS)
    model.train()
    step = 0
    while step < STEPS:
        for batch in batches:
            model(**batch).loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            step += 1
            if step == STEPS:
                break

    summary = predict(
        Predictor(model, tokenizer, device="cpu"),
        data_dir,
        "validation",
        out=tmp_path / "predictions.jsonl",
        options=GenerationOptions(),
        limit=HELD_OUT_QUESTIONS,
        progress=False,
    )
    metrics = summary["metrics"]
    selected, baseline = metrics["components"]["sel"], metrics["baseline"]["components"]["sel"]
    print(
        f"held-out select column {selected:.1%} (first column {baseline:.1%}), logical form {metrics['lf_accuracy']:.1%}"
    )
    assert selected >= baseline + MARGIN, f"select column {selected:.1%} against the first column's {baseline:.1%}"
