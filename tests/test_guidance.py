"""Execution-guided decoding: among the beams, the first query that runs on the table's rows and finds something."""

import pytest
import torch

from textsql.arguments import GenerationOptions
from textsql.data.sql import parse_sql
from textsql.errors import SQLParseError
from textsql.inference.guidance import ExecutionGuide
from textsql.inference.predict import predict
from textsql.inference.predictor import Predictor
from textsql.json_files import write_jsonl
from textsql.scoring.engine import ExecutionError, TableEngine

HEADER = ["Player", "No.", "School"]
TABLES = {
    "t1": {
        "id": "t1",
        "header": HEADER,
        "types": ["text", "real", "text"],
        "rows": [["Ann", 3, "Duke"], ["Bob", 5, "Yale"], ["Cy", 12, "Duke"]],
    }
}
ITEMS = [
    {
        "id": "q0",
        "table_id": "t1",
        "question": "Which player wore number 3 at Duke?",
        "header": HEADER,
        "sql": {"sel": 0, "agg": 0, "conds": [[1, 0, "3"]]},
    },
    {
        "id": "q1",
        "table_id": "t1",
        "question": "How many players came from Yale?",
        "header": HEADER,
        "sql": {"sel": 0, "agg": 3, "conds": [[2, 0, "Yale"]]},
    },
]
NEW_TOKENS = 32


def finds_something(engine: TableEngine, text: str) -> bool:
    try:
        return any(value is not None for value in engine.execute("t1", parse_sql(text, HEADER)))
    except (SQLParseError, ExecutionError):
        return False


def first_finding(engine: TableEngine, own: list[str]) -> str:
    """What guidance must choose among one question's beams: the first that finds something, else the first."""
    return next((beam for beam in own if finds_something(engine, beam)), own[0])


def test_the_first_beam_that_runs_and_finds_something_is_chosen():
    candidates = [
        "SELECT Player FROM",  # no query
        "SELECT Player FROM table WHERE No. > many",  # a word compared with a number column: fails
        "SELECT Player FROM table WHERE School = Harvard",  # runs, finds nothing
        "SELECT MAX No. FROM table WHERE School = Oxford",  # an aggregate of nothing: NULL
        "SELECT Player FROM table WHERE School = Duke",  # runs, finds Ann and Cy
        "SELECT Player FROM table",
    ]
    with ExecutionGuide(TABLES) as guide:
        assert guide.choose(candidates, HEADER, "t1") == candidates[4]
        assert guide.choose(candidates[:4], HEADER, "t1") == candidates[0]
        assert guide.choose(candidates[2:], HEADER, "no-such-table") == candidates[2]
    rowless = {"t1": {**TABLES["t1"], "rows": []}}
    with ExecutionGuide(rowless) as guide:
        assert guide.choose(candidates[2:], HEADER, "t1") == candidates[2]


# Each question's beams, best first, as a beam search would return them: for q0 the first finds nothing
# and the second fails to execute, so guidance must answer with the third; q1's first already finds.
BEAMS = {
    "q0": [
        "SELECT Player FROM table WHERE School = Harvard",
        "SELECT Player FROM table WHERE No. = Duke",
        "SELECT Player FROM table WHERE No. = 3",
        "SELECT Player FROM table",
    ],
    "q1": [
        "SELECT COUNT Player FROM table WHERE School = Yale",
        "SELECT Player FROM table WHERE School = Yale",
        "SELECT Player FROM table WHERE School = Harvard",
        "SELECT Player FROM table",
    ],
}
GUIDED = {"q0": BEAMS["q0"][2], "q1": BEAMS["q1"][0]}


class FixedBeams(torch.nn.Module):
    """A model whose beam search returns fixed beams per question, so what guidance must choose is known."""

    def __init__(self, tokenizer, beams_by_input: dict[tuple[int, ...], list[str]]):
        super().__init__()
        self.tokenizer = tokenizer
        self.beams_by_input = beams_by_input
        self.calls: list[dict] = []

    def generate(self, input_ids, attention_mask, num_beams, num_return_sequences, **options):
        self.calls.append({"num_beams": num_beams, "num_return_sequences": num_return_sequences})
        texts = [
            beam
            for ids, mask in zip(input_ids.tolist(), attention_mask.tolist())
            for beam in self.beams_by_input[tuple(i for i, m in zip(ids, mask) if m)][:num_return_sequences]
        ]
        return self.tokenizer(texts, padding=True, return_tensors="pt")["input_ids"]


@pytest.fixture(scope="module")
def predictor() -> Predictor:
    """The untrained embedded model (its beams are whatever its random weights give)."""
    torch.manual_seed(0)
    return Predictor.load(None, device="cpu")


def fixed_beams(predictor: Predictor) -> tuple[Predictor, list[list[int]]]:
    input_ids = [predictor.encode(item["question"], item["header"]) for item in ITEMS]
    beams = {tuple(ids): BEAMS[item["id"]] for ids, item in zip(input_ids, ITEMS)}
    return Predictor(FixedBeams(predictor.tokenizer, beams), predictor.tokenizer, device="cpu"), input_ids


def test_the_fixed_beams_are_what_the_test_says(predictor):
    tokenizer = predictor.tokenizer
    for beams in BEAMS.values():
        assert tokenizer.batch_decode(tokenizer(beams)["input_ids"], skip_special_tokens=True) == beams
    with TableEngine(TABLES) as engine:
        assert {item: first_finding(engine, beams) for item, beams in BEAMS.items()} == GUIDED


def test_predictor_answers_with_the_first_executing_beam(predictor):
    fixed, input_ids = fixed_beams(predictor)
    options = GenerationOptions(num_beams=len(BEAMS["q0"]), max_new_tokens=NEW_TOKENS, batch_size=1)
    chosen = fixed.generate(input_ids, options, items=ITEMS, tables=TABLES)
    assert chosen == [GUIDED[item["id"]] for item in ITEMS]
    assert fixed.model.calls[-1] == {"num_beams": 4, "num_return_sequences": 4}
    unguided = fixed.generate(
        input_ids,
        GenerationOptions(num_beams=4, max_new_tokens=NEW_TOKENS, execution_guided=False),
        items=ITEMS,
        tables=TABLES,
    )
    assert unguided == [BEAMS[item["id"]][0] for item in ITEMS]
    assert fixed.model.calls[-1] == {"num_beams": 4, "num_return_sequences": 1}
    # Without rows there is nothing to run a query on: the best beam, as without guidance.
    rowless = {"t1": {**TABLES["t1"], "rows": []}}
    assert fixed.generate(input_ids, options, items=ITEMS, tables=rowless) == unguided


def test_predict_on_records_with_rows_is_guided_and_scored_by_execution(predictor, tmp_path):
    data = tmp_path / "questions.jsonl"
    write_jsonl(data, [{**item, **{key: TABLES["t1"][key] for key in ("types", "rows")}} for item in ITEMS])
    summary = predict(
        predictor,
        data,
        out=tmp_path / "predictions.jsonl",
        options=GenerationOptions(num_beams=4, max_new_tokens=24),
        progress=False,
    )
    metrics = summary["metrics"]
    assert metrics["parse_rate"] == 1.0 and metrics["ex_accuracy"] is not None
    assert metrics["inference"]["constrained"] is True
