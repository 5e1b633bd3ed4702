"""Decoding constrained to each question's WikiSQL grammar: real sample tables, an untrained model, beams, EOS."""

import random

import pytest
import torch
from click.testing import CliRunner
from transformers import GenerationConfig, LogitsProcessorList

from textsql.arguments import GenerationOptions
from textsql.cli import cli
from textsql.constants import MAX_CONDITIONS
from textsql.data.sql import parse_sql, render_sql
from textsql.data.wikisql import cased_sql, load_split, read_source_text, source_text, target_text
from textsql.decoding.grammar import QueryAutomaton, compile_automata
from textsql.decoding.processor import grammar_processor, processor_for_inputs
from textsql.inference.predictor import Predictor
from textsql.model import load_tokenizer
from textsql.training.trainer import generation_budget

PLAYERS = ["Player", "No.", "Nationality", "Position", "Years in Toronto", "School/Club Team"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return load_split("sample", "validation")[0]


@pytest.fixture(scope="module")
def predictor() -> Predictor:
    torch.manual_seed(0)
    return Predictor.load(None, device="cpu")


def walk(tokenizer, automaton: QueryAutomaton, text: str) -> list[int]:
    """The states a text's tokens (then EOS) go through; fails on the first token the grammar refuses."""
    state, states = automaton.start, []
    for token in tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]:
        assert token in automaton.allowed(state, 1000).tolist(), f"{tokenizer.decode([token])!r} refused in {text!r}"
        state = automaton.advance(state, token)
        states.append(state)
    return states


def refused(tokenizer, automaton: QueryAutomaton, text: str) -> bool:
    """Whether the grammar refuses some token of ``text`` (EOS not included)."""
    state = automaton.start
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if token not in automaton.allowed(state, 1000).tolist():
            return True
        state = automaton.advance(state, token)
    return False


def record(records: list[dict], record_id: str) -> dict:
    return next(item for item in records if item["id"] == record_id)


def random_query(tokenizer, automaton: QueryAutomaton, rng: random.Random, budget: int) -> str:
    state, tokens = automaton.start, []
    for step in range(budget):
        token = rng.choice(automaton.allowed(state, budget - step).tolist())
        tokens.append(token)
        state = automaton.advance(state, token)
        if token == tokenizer.eos_token_id:
            break
    assert tokens[-1] == tokenizer.eos_token_id, "a query cut off before EOS"
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()


@pytest.mark.parametrize(
    "record_id",
    [
        "validation-1",  # COUNT, multi-word column, a number from the question ("number 3 play")
        "validation-24",  # headers with commas, LT, a long number, a value with a comma and "(1.89%)?"
        "validation-22",  # comma headers, a value of many words with em dashes
    ],
)
def test_the_gold_query_is_in_the_grammar_of_its_table(tokenizer, records, record_id):
    record = next(item for item in records if item["id"] == record_id)
    automaton = QueryAutomaton.build(tokenizer, record["question"], record["header"])
    walk(tokenizer, automaton, target_text(record))


def test_nearly_every_gold_query_of_the_sample_is_in_its_grammar(tokenizer, records):
    """The few that are not use characters T5's vocabulary lacks, or values that are no span of the question."""
    automata = compile_automata(tokenizer, [item["question"] for item in records], [item["header"] for item in records])
    inside = 0
    for record, automaton in zip(records, automata):
        try:
            walk(tokenizer, automaton, target_text(record))
            inside += 1
        except AssertionError:
            pass
    assert inside / len(records) >= 0.9


def test_every_query_the_grammar_allows_parses_over_its_table(tokenizer, records):
    rng = random.Random(0)
    automata = compile_automata(tokenizer, [item["question"] for item in records], [item["header"] for item in records])
    for record, automaton in zip(records, automata):
        for budget in (24, 64):
            query = parse_sql(random_query(tokenizer, automaton, rng, budget), record["header"])
            columns = [query["sel"], *(col for col, _, _ in query["conds"])]
            assert all(0 <= col < len(record["header"]) for col in columns)
            # As in WikiSQL: at most four conditions, no column named twice, the selected one included.
            assert len(query["conds"]) <= MAX_CONDITIONS and len(set(columns)) == len(columns)


def test_at_most_four_conditions_each_on_a_column_not_named_before(tokenizer, records):
    """WikiSQL's dev and test (24,299 queries) have at most 4 conditions, never a column twice, never the selected one."""
    players = record(records, "validation-4")  # "What player played guard for toronto in 1996-97?"
    automaton = QueryAutomaton.build(tokenizer, players["question"], players["header"])
    four = "SELECT Player FROM table WHERE Position = guard AND Years in Toronto = 1996-97 AND No. = for AND Nationality = toronto"
    walk(tokenizer, automaton, four)
    assert refused(tokenizer, automaton, four + " AND School/Club Team = in")
    assert refused(tokenizer, automaton, "SELECT Player FROM table WHERE Player = guard")
    assert refused(tokenizer, automaton, "SELECT Player FROM table WHERE Position = guard AND Position = toronto")


def test_a_column_whose_name_begins_another_is_told_apart(tokenizer, records):
    district = record(records, "validation-80")  # "Foreign nationals" and "Foreign nationals in %"
    automaton = QueryAutomaton.build(tokenizer, district["question"], district["header"])
    walk(tokenizer, automaton, "SELECT COUNT Foreign nationals FROM table WHERE Foreign nationals in % = 4.911")
    walk(tokenizer, automaton, "SELECT COUNT Foreign nationals in % FROM table WHERE Foreign nationals = 4.911")
    assert refused(tokenizer, automaton, "SELECT COUNT Foreign nationals FROM table WHERE Foreign nationals = 4.911")


def test_a_table_with_fewer_columns_has_fewer_conditions(tokenizer):
    question = "Who played guard for 3 years?"
    single = QueryAutomaton.build(tokenizer, question, ["Player"])
    assert refused(tokenizer, single, "SELECT Player FROM table WHERE")
    walk(tokenizer, single, "SELECT MAX Player FROM table")
    pair = QueryAutomaton.build(tokenizer, question, ["Player", "Position"])
    walk(tokenizer, pair, "SELECT Player FROM table WHERE Position = guard")
    assert refused(tokenizer, pair, "SELECT Player FROM table WHERE Position = guard AND")
    assert refused(tokenizer, pair, "SELECT Player FROM table WHERE Player")


def test_a_short_budget_ends_in_eos_when_the_shortest_column_is_selected(tokenizer):
    """A condition then needs a longer column: WHERE is allowed only where that one still fits."""
    header = ["No.", "School/Club Team"]
    automaton = QueryAutomaton.build(tokenizer, "Who is number 3?", header)
    rng = random.Random(2)
    for budget in [*range(8, 24)] * 20:
        parse_sql(random_query(tokenizer, automaton, rng, budget), header)


def test_eos_exactly_where_a_query_may_end(tokenizer):
    automaton = QueryAutomaton.build(tokenizer, "How many schools did player number 3 play at?", PLAYERS)
    eos = tokenizer.eos_token_id
    text = "SELECT COUNT School/Club Team FROM table WHERE No. LT 3"
    ends = [
        tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][: index + 1])
        for index in range(len(walk(tokenizer, automaton, text)) - 1)
    ]
    states = walk(tokenizer, automaton, text)
    allows_eos = [eos in automaton.allowed(state, 1000).tolist() for state in states[:-1]]
    assert [end for end, allowed in zip(ends, allows_eos) if allowed] == [
        "SELECT COUNT School/Club Team FROM table",
        text,
    ]
    assert automaton.allowed(automaton.start, 1000).tolist() != [eos]
    # After EOS only EOS or padding follow (a greedy search pads finished rows).
    assert sorted(automaton.allowed(states[-1], 1000).tolist()) == sorted({eos, tokenizer.pad_token_id})


def test_values_are_spans_of_the_question_with_their_glued_punctuation_dropped(tokenizer):
    automaton = QueryAutomaton.build(tokenizer, 'What is Rice\'s score at the "Big game"?', ["Team", "Score"])
    for value in ("Rice", "rice's", "Big game", '"Big game"', "score at the", "What"):
        walk(tokenizer, automaton, f"SELECT Score FROM table WHERE Team = {value}")
    with pytest.raises(AssertionError):
        walk(tokenizer, automaton, "SELECT Score FROM table WHERE Team = Duke")


def test_a_short_budget_still_ends_in_a_whole_query(tokenizer):
    rng = random.Random(1)
    automaton = QueryAutomaton.build(tokenizer, "How many schools did player number 3 play at?", PLAYERS)
    for _ in range(50):
        parse_sql(random_query(tokenizer, automaton, rng, 12), PLAYERS)


# Four constrained beams over twelve questions: a minute and a half here, so outside `make test-fast`.
@pytest.mark.parametrize("num_beams", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_an_untrained_model_writes_only_queries_over_each_table(predictor, records, num_beams):
    """The hardest case: random weights, which unconstrained write no SQL at all."""
    items = records[:12]
    input_ids = [predictor.encode(item["question"], item["header"]) for item in items]
    options = GenerationOptions(batch_size=6, num_beams=num_beams, max_new_tokens=40)
    for text, item in zip(predictor.generate(input_ids, options, items=items), items):
        query = parse_sql(text, item["header"])
        assert all(0 <= col < len(item["header"]) for col in [query["sel"], *(cond[0] for cond in query["conds"])])
    free = predictor.generate(
        input_ids, GenerationOptions(batch_size=6, num_beams=num_beams, max_new_tokens=40, constrained=False)
    )
    assert not any(text.startswith("SELECT") for text in free)


def test_every_beam_is_a_query(predictor, tokenizer, records):
    items = records[:3]
    batch = tokenizer.pad(
        [{"input_ids": predictor.encode(item["question"], item["header"])} for item in items], return_tensors="pt"
    )
    processor = grammar_processor(
        tokenizer, [item["question"] for item in items], [item["header"] for item in items], 40
    )
    with torch.inference_mode():
        output = predictor.model.generate(
            **batch,
            num_beams=4,
            num_return_sequences=4,
            max_new_tokens=40,
            logits_processor=LogitsProcessorList([processor]),
        )
    texts = tokenizer.batch_decode(output, skip_special_tokens=True)
    for index, text in enumerate(texts):
        parse_sql(text, items[index // 4]["header"])


def test_questions_and_headers_are_read_back_from_model_inputs(tokenizer, records):
    record = next(item for item in records if item["id"] == "validation-24")
    encoded = tokenizer([source_text(record["question"], record["header"])], return_tensors="pt")["input_ids"]
    question, header = read_source_text(tokenizer.decode(encoded[0], skip_special_tokens=True))
    assert (question, header) == (record["question"], record["header"])
    assert read_source_text(source_text("Who?", ["A"], "question")) == ("Who?", None)
    assert processor_for_inputs(tokenizer, encoded, 40).automata[0] is not None


@pytest.mark.parametrize("trainer_class", ["run's trainer", "time to accuracy's peer"])
def test_the_evaluation_during_training_generates_only_queries(predictor, records, tmp_path, trainer_class):
    """textsql train's trainer, and the peer's in the time-to-accuracy bench, which must evaluate alike."""
    import datasets
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainingArguments

    from bench.accuracy import GrammarScoredPeer
    from textsql.training.trainer import GrammarSeq2SeqTrainer

    trainer_class = GrammarSeq2SeqTrainer if trainer_class == "run's trainer" else GrammarScoredPeer
    tokenizer, items = predictor.tokenizer, records[:6]
    dataset = datasets.Dataset.from_dict(
        {
            "input_ids": [predictor.encode(item["question"], item["header"]) for item in items],
            "labels": [tokenizer(target_text(item))["input_ids"] for item in items],
        }
    )
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        per_device_eval_batch_size=3,
        predict_with_generate=True,
        generation_max_length=32,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = trainer_class(
        model=predictor.model,
        args=args,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=predictor.model),
    )
    output = trainer.predict(dataset)
    predictions = torch.where(
        torch.tensor(output.predictions) < 0, tokenizer.pad_token_id, torch.tensor(output.predictions)
    )
    for text, item in zip(tokenizer.batch_decode(predictions, skip_special_tokens=True), items):
        parse_sql(text, item["header"])


def test_the_generation_budget_follows_generate():
    config = GenerationConfig(max_length=64)
    assert generation_budget({}, config) == 63
    assert generation_budget({"max_length": 20}, config) == 19
    assert generation_budget({"max_new_tokens": 10, "max_length": 20}, config) == 10
    assert generation_budget({}, GenerationConfig(max_new_tokens=30)) == 30


def test_cli_answers_one_question_constrained_and_free():
    for flags, parses in (([], True), (["--no-constrained"], False)):
        result = CliRunner().invoke(
            cli,
            [
                "infer",
                "--model",
                "default",
                "--question",
                "How many schools did player number 3 play at?",
                "--header",
                ",".join(PLAYERS),
                "--max-new-tokens",
                "24",
                "--device",
                "cpu",
                *flags,
            ],
        )
        assert result.exit_code == 0, result.output
        assert ('"error": null' in result.output) is parses, result.output


def test_no_aggregation_beats_an_aggregation_that_beats_each_column_alone(tokenizer):
    """Right after SELECT, "no aggregation" is every column's first token together: per beam row, an
    aggregation is kept only if its score beats that sum, and the columns are masked only then."""
    processor = grammar_processor(tokenizer, ["How many schools did player number 3 play at?"], [PLAYERS], 64)
    select = tokenizer("SELECT", add_special_tokens=False)["input_ids"]
    count = tokenizer("COUNT", add_special_tokens=False)["input_ids"][0]
    columns = {tokenizer(name, add_special_tokens=False)["input_ids"][0] for name in PLAYERS}
    input_ids = torch.tensor([[tokenizer.pad_token_id, *select]] * 2)
    scores = torch.full((2, len(tokenizer)), -30.0)
    # Row 0: COUNT 0.2 beats each column's 0.1 but not their 0.6; row 1: COUNT 0.6 beats all 0.3.
    scores[0, list(columns)], scores[0, count] = torch.tensor(0.1).log(), torch.tensor(0.2).log()
    scores[1, list(columns)], scores[1, count] = torch.tensor(0.05).log(), torch.tensor(0.6).log()
    kept = processor(input_ids, scores.clone()).isfinite()
    assert set(kept[0].nonzero().flatten().tolist()) == columns
    assert kept[1, count]
    assert not kept[1, list(columns)].any()
    assert processor(input_ids, scores.clone())[0].argmax().item() in columns


def test_the_uncased_grammar_writes_the_lower_case_queries_it_was_trained_on(tokenizer, records):
    """The uncased input format trains on lower-case queries: the grammar takes them, not the cased ones, and what
    it writes reads back over the table's header in the header's case."""
    questions = [source_text(item["question"], item["header"], "uncased") for item in records]
    read_back = [read_source_text(text) for text in questions]
    automata = compile_automata(
        tokenizer, [question for question, _ in read_back], [header for _, header in read_back], uncased=True
    )
    inside = 0
    for item, automaton in zip(records, automata):
        assert refused(tokenizer, automaton, target_text(item)), "the cased query is outside the uncased grammar"
        try:
            walk(tokenizer, automaton, target_text(item, "uncased"))
            inside += 1
        except AssertionError:
            pass
    assert inside / len(records) >= 0.9
    rng = random.Random(0)
    for item, automaton in zip(records, automata):
        text = random_query(tokenizer, automaton, rng, 48)
        assert text == text.lower()
        cased = cased_sql(text, item["question"], item["header"])
        query = parse_sql(cased, item["header"])
        assert cased == render_sql(query, item["header"]) and cased.startswith("SELECT ")
        # Each value comes back as the question writes it.
        assert all(value in " ".join(item["question"].split()) for _, _, value in query["conds"])


def test_an_uncased_predictor_answers_in_the_headers_case(tokenizer):
    torch.manual_seed(0)
    predictor = Predictor.load(None, input_format="uncased", device="cpu")
    answer = predictor.ask(
        "How many schools did player number 3 play at?", PLAYERS, GenerationOptions(max_new_tokens=32)
    )
    assert answer["error"] is None and answer["sql"].startswith("SELECT ")
    assert answer["sql"] == render_sql(answer["query"], PLAYERS)


def test_beams_rank_queries_by_their_probability_among_what_the_grammar_allows(predictor, records, monkeypatch):
    """Each step's scores that beam search adds up are a distribution over the tokens the grammar allows.

    Left as the model's log-probabilities over the whole vocabulary with the refused tokens cut out, a beam through a
    column the model would not have named (a header it never saw) pays for the names it may not write, and beams
    drift to the columns whose names it half knows: on the demo's model, four beams without execution guidance fell
    from greedy's 52.5 % logical form to 37 % (select 85 % to 71 %), renormalised they score 52.5 %, guided 56.5 %.
    """
    items = records[:4]
    steps: list[torch.Tensor] = []
    generate = predictor.model.generate

    def recording(**arguments):
        output = generate(**arguments, output_scores=True, return_dict_in_generate=True)
        steps.extend(output.scores)
        return output.sequences

    monkeypatch.setattr(predictor.model, "generate", recording)
    input_ids = [predictor.encode(item["question"], item["header"]) for item in items]
    options = GenerationOptions(batch_size=4, num_beams=3, max_new_tokens=24, execution_guided=False)
    predictor.generate(input_ids, options, items=items)
    assert steps
    for scores in steps:
        live = scores[torch.isfinite(scores).any(-1)]
        assert torch.allclose(live.logsumexp(-1), torch.zeros(len(live)), atol=1e-4)


def test_a_beam_the_grammar_left_nowhere_to_go_is_minus_infinity_beside_live_ones(tokenizer, monkeypatch):
    """A row with no token left to write scores -inf everywhere, not NaN (beam search would rank NaN above every
    live beam), while the other rows stay distributions over what the grammar allows."""
    question = "How many schools did player number 3 play at?"
    processor = grammar_processor(tokenizer, [question, question], [PLAYERS, PLAYERS], 64)
    monkeypatch.setattr(processor.automata[1], "allowed", lambda state, remaining: torch.tensor([], dtype=torch.long))
    select = tokenizer("SELECT", add_special_tokens=False)["input_ids"]
    processed = processor(torch.tensor([[tokenizer.pad_token_id, *select]] * 2), torch.randn(2, len(tokenizer)))
    assert not processed.isnan().any()
    assert processed[1].isneginf().all()
    assert torch.allclose(processed[0].logsumexp(-1), torch.tensor(0.0), atol=1e-5)
