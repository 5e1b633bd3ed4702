"""The model card training writes beside the model (model/README.md) and evaluation updates: it parses with
huggingface_hub's own ModelCard, and its model-index holds the scores metrics.json holds, per source and split."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from bench.tiny_run import tiny_run_argv
from textsql.constants import METRICS_NAME, PREPARE_JSON_NAME
from textsql.inference.predict import predict
from textsql.inference.predictor import Predictor
from textsql.model_card import CARD_NAME, NOT_EVALUATED, record_evaluation, write_training_card

RUN = {
    "model": "t5-small",
    "profile": "zero2",
    "zero_stage": 2,
    "precision": "bf16",
    "world_size": 4,
    "global_step": 900,
    "log_history": [
        {"loss": 3.1, "step": 10},
        {"eval_loss": 1.2, "eval_lf_accuracy": 0.41234, "eval_parse_rate": 1.0, "eval_ex_accuracy": 0.5, "step": 900},
        {"train_loss": 1.75, "train_runtime": 60.0, "step": 900},
    ],
}
METRICS = {
    "n": 200,
    "lf_accuracy": 0.455,
    "ex_accuracy": 0.52,
    "lf_standard_error": 0.0352,
    "ex_standard_error": 0.0353,
    "parse_rate": 1.0,
    "baseline": {"lf_accuracy": 0.035, "ex_accuracy": 0.08, "parse_rate": 1.0},
}


def scores(card: ModelCard) -> dict[tuple, dict[str, float]]:
    """(dataset type, config, split) -> {metric type: value} of a card's model-index."""
    found: dict[tuple, dict[str, float]] = {}
    for result in card.data.eval_results or []:
        key = (result.dataset_type, result.dataset_config, result.dataset_split)
        found.setdefault(key, {})[result.metric_type] = result.metric_value
    return found


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "run-42" / "model"
    model.mkdir(parents=True)
    (model / PREPARE_JSON_NAME).write_text(
        json.dumps({"source": "hub", "input_format": "schema", "counts": {"train": 56355, "validation": 8421}})
    )
    return model


def test_training_writes_a_card_the_hub_classes_read_back_with_the_final_evaluation(model_dir):
    path = write_training_card(model_dir, RUN, hardware="4 ranks on NVIDIA H100")
    card = ModelCard.load(path)
    assert (card.data.language, card.data.license, card.data.base_model) == ("en", "apache-2.0", "t5-small")
    assert card.data.datasets == ["Salesforce/wikisql"] and card.data.model_name == "textsql-run-42"
    assert scores(card) == {
        ("Salesforce/wikisql", None, "validation"): {"lf_accuracy": 0.4123, "ex_accuracy": 0.5, "parse_rate": 1.0}
    }
    for fact in ("fine-tuned from `t5-small`", "56355 training questions", "`schema`", "| steps | 900", "`zero2`"):
        assert fact in card.text, fact
    assert "4 ranks on NVIDIA H100" in card.text and "41.2 %" in card.text


def test_a_run_without_evaluation_says_how_to_score_it_and_names_no_base_for_random_weights(model_dir):
    run = {**RUN, "model": "default", "log_history": [{"train_loss": 2.0, "step": 4}]}
    card = ModelCard.load(write_training_card(model_dir, run, hardware="1 rank on CPU (gloo)"))
    assert card.data.base_model is None and not card.data.eval_results
    assert NOT_EVALUATED in card.text and "random weights" in card.text


def test_evaluation_replaces_its_own_split_and_keeps_the_others(model_dir):
    write_training_card(model_dir, RUN, hardware="4 ranks on NVIDIA H100")
    record_evaluation(model_dir, METRICS, "hub", "validation")
    record_evaluation(model_dir, {**METRICS, "lf_accuracy": 0.1}, "sample", "test")
    card = ModelCard.load(model_dir / CARD_NAME)
    assert scores(card) == {
        ("Salesforce/wikisql", None, "validation"): {"lf_accuracy": 0.455, "ex_accuracy": 0.52, "parse_rate": 1.0},
        ("Salesforce/wikisql", "sample", "test"): {"lf_accuracy": 0.1, "ex_accuracy": 0.52, "parse_rate": 1.0},
    }
    # One scores block per split, the baseline beside the model's; the training-time block was replaced.
    assert card.text.count("<!-- result ") == 2 and "41.2 %" not in card.text
    assert "| Logical-form accuracy (LF) | 45.5 % ± 3.5 | 3.5 % |" in card.text
    assert "| Parse rate | 100.0 % | 100.0 % |" in card.text  # a rate of the model's own output, no sample
    record_evaluation(model_dir, {**METRICS, "lf_accuracy": 0.6}, "hub", "validation")
    again = ModelCard.load(model_dir / CARD_NAME)
    assert scores(again)[("Salesforce/wikisql", None, "validation")]["lf_accuracy"] == 0.6
    assert again.text.count("<!-- result ") == 2 and "Limits" in again.text


def test_a_model_without_a_card_is_left_alone(tmp_path):
    assert record_evaluation(tmp_path, METRICS, "sample", "validation") is None
    assert record_evaluation(None, METRICS, "sample", "validation") is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_short_training_writes_the_card_and_evaluation_puts_metrics_json_in_it(prepared_sample, tmp_path):
    command = [
        str(Path(sys.executable).with_name("textsql")),
        "train",
        *tiny_run_argv(
            prepared_sample,
            tmp_path,
            max_steps=2,
            eval_every=None,
            profile="zero0",
            save_steps=2,
            max_eval_samples=4,
            generation_max_length=8,
            logging_steps=None,
        ),
    ]
    result = subprocess.run(
        command, check=False, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    model = tmp_path / "model"
    card = ModelCard.load(model / CARD_NAME)
    run = json.loads((tmp_path / "run.json").read_text())
    final = next(entry for entry in reversed(run["log_history"]) if "eval_lf_accuracy" in entry)
    ((dataset, trained),) = scores(card).items()
    assert dataset == ("Salesforce/wikisql", "sample", "validation")
    assert trained["lf_accuracy"] == round(final["eval_lf_accuracy"], 4) and trained["parse_rate"] == round(
        final["eval_parse_rate"], 4
    )
    assert "| steps | 2," in card.text and "1 rank on CPU (gloo)" in card.text

    predict(Predictor.load(model), prepared_sample, "validation", out=tmp_path / "predictions.jsonl", limit=4)
    metrics = json.loads((tmp_path / METRICS_NAME).read_text())
    # The prepared sample's tables carry no rows: no execution accuracy, in metrics.json or in the card.
    expected = {
        key: round(metrics[key], 4) for key in ("lf_accuracy", "ex_accuracy", "parse_rate") if metrics[key] is not None
    }
    assert scores(ModelCard.load(model / CARD_NAME)) == {dataset: expected} and "parse_rate" in expected
