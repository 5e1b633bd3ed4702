"""The CML Model: cml/model.py imported by its path and `predict(dict)` called as CML calls it, over the embedded
small T5 saved with weights; and the AMP's create/build/deploy model tasks serving it through the emulated endpoint."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from textsql.inference import serving
from textsql.model import load_model, load_tokenizer

PROJECT_DIR = Path(__file__).resolve().parent.parent
MODEL_FILE = PROJECT_DIR / "cml" / "model.py"
HEADER = ["City", "Country", "Population"]
ROWS = [["Oslo", "Norway", 709000], ["Bergen", "Norway", "291,000"], ["Lyon", "France", 522000]]


def save_tiny_model(target: Path) -> Path:
    """The embedded small T5 (random weights from its fixed seed) saved as a trained model/ is."""
    load_model().save_pretrained(target)
    load_tokenizer().save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("run") / "model")


@pytest.fixture
def cml_predict(model_dir, monkeypatch):
    """`predict` of cml/model.py as a CML replica loads it: the file by its path, a fresh module."""
    monkeypatch.setenv(serving.MODEL_DIR_VAR, str(model_dir))
    spec = importlib.util.spec_from_file_location("cml_model_under_test", MODEL_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.predict


def test_a_question_gets_a_query_over_its_header_and_the_answer_over_its_rows(cml_predict):
    response = cml_predict({"question": "What is the population of Oslo?", "header": HEADER})
    assert set(response) == {"sql", "query"}, response
    query = response["query"]
    assert {"sel", "agg", "conds"} <= set(query) and 0 <= query["sel"] < len(HEADER)
    assert response["sql"].startswith("SELECT ") and "FROM table" in response["sql"]

    # All columns text: every WikiSQL query runs, and its answer is what WikiSQL's engine computes over the rows.
    texts = ["text"] * len(HEADER)
    with_rows = cml_predict(
        {"question": "What is the population of Oslo?", "header": HEADER, "rows": ROWS, "types": texts}
    )
    assert with_rows["query"] == query and "error" not in with_rows, with_rows
    with serving.TableEngine({"t": {"header": HEADER, "types": texts, "rows": ROWS}}) as engine:
        assert with_rows["answer"] == engine.execute("t", query)

    # Types read from the rows (Population a number, "291,000" too): a query comparing it with a word does not run,
    # and the response says so beside the query instead of answering.
    inferred = cml_predict({"question": "What is the population of Oslo?", "header": HEADER, "rows": ROWS})
    with serving.TableEngine({"t": {"header": HEADER, "types": ["text", "text", "real"], "rows": ROWS}}) as engine:
        try:
            expected = engine.execute("t", inferred["query"])
        except serving.ExecutionError:
            assert "answer" not in inferred and "does not run over these rows" in inferred["error"], inferred
        else:
            assert inferred["answer"] == expected and "error" not in inferred, inferred


def test_the_model_is_loaded_once(cml_predict, model_dir):
    cml_predict({"question": "Which city is in France?", "header": HEADER})
    loaded = serving._loaded[model_dir]
    cml_predict({"question": "Which city is in Norway?", "header": HEADER})
    assert serving._loaded[model_dir] is loaded


@pytest.mark.parametrize(
    ("request_", "names"),
    [
        ("What is Oslo?", "JSON object"),
        ({"header": HEADER}, '"question"'),
        ({"question": 3, "header": HEADER}, '"question"'),
        ({"question": "x" * (serving.MAX_QUESTION_CHARS + 1), "header": HEADER}, "at most 500"),
        ({"question": "Who?", "header": "City,Country"}, '"header"'),
        ({"question": "Who?", "header": []}, '"header"'),
        ({"question": "Who?", "header": ["c"] * (serving.MAX_COLUMNS + 1)}, '"header"'),
        ({"question": "Who?", "header": ["City", 7]}, '"header"'),
        ({"question": "Who?", "headers": HEADER}, "unknown field 'headers'"),
        ({"question": "Who?", "header": HEADER, "rows": [["Oslo", "Norway"]]}, '"rows"[0] must be a list of 3'),
        ({"question": "Who?", "header": HEADER, "rows": [["Oslo", "Norway", {"n": 1}]]}, '"rows"[0] holds a cell'),
        ({"question": "Who?", "header": HEADER, "rows": [ROWS[0]] * (serving.MAX_ROWS + 1)}, "at most 1000 rows"),
        ({"question": "Who?", "header": HEADER, "types": ["text"]}, '"types"'),
    ],
)
def test_a_bad_request_is_answered_with_one_line_naming_the_fix(cml_predict, request_, names):
    response = cml_predict(request_)
    assert list(response) == ["error"] and names in response["error"], response
    assert "\n" not in response["error"]


def test_before_training_the_model_answers_an_error_and_loads_once_it_exists(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.delenv(serving.MODEL_DIR_VAR, raising=False)
    monkeypatch.setenv(serving.RUN_DIR_VAR, str(run_dir))
    spec = importlib.util.spec_from_file_location("cml_model_before_training", MODEL_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    request = {"question": "Which city is in France?", "header": HEADER}
    early = module.predict(request)
    assert (
        list(early) == ["error"] and "no trained model" in early["error"] and "run the training job" in early["error"]
    )
    save_tiny_model(run_dir / "model")
    assert set(module.predict(request)) == {"sql", "query"}


def test_the_served_model_dir_follows_the_amp_run_dir_relative_to_the_project():
    root = Path("/home/cdsw")
    assert serving.served_model_dir({"TEXTSQL_RUN_DIR": "runs/cml"}, root) == root / "runs" / "cml" / "model"
    assert serving.served_model_dir({"TEXTSQL_MODEL_DIR": "/m", "TEXTSQL_RUN_DIR": "runs/cml"}, root) == Path("/m")
    with pytest.raises(serving.ModelError, match="TEXTSQL_MODEL_DIR"):
        serving.served_model_dir({}, root)


def test_column_types_are_real_only_where_every_cell_is_a_number():
    assert serving.column_types(ROWS, 3) == ["text", "text", "real"]
    assert serving.column_types([], 2) == ["text", "text"]


@pytest.mark.slow
def test_the_amp_model_tasks_serve_the_trained_model_at_the_emulated_endpoint(tmp_path):
    spec = importlib.util.spec_from_file_location("amp_import", PROJECT_DIR / "tests" / "fakes" / "amp_import.py")
    amp_import = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = amp_import  # dataclasses look their module up while the class is built
    spec.loader.exec_module(amp_import)
    metadata = yaml.safe_load((PROJECT_DIR / ".project-metadata.yaml").read_text())
    model_tasks = [task for task in metadata["tasks"] if task["type"].endswith("_model")]
    assert [task["type"] for task in model_tasks] == ["create_model", "build_model", "deploy_model"]
    run_dir = tmp_path / "run"
    project = amp_import.AmpImport(metadata, PROJECT_DIR, {"TEXTSQL_RUN_DIR": str(run_dir)})
    for task in model_tasks:
        run = project.run(task)
        assert run.returncode in (None, 0), run.output[-2000:]
    (model,) = project.models.values()
    key = model["access_key"]
    assert project.environment()[model["task"]["access_key_environment_variable"]] == key
    (example,) = model["build"]["examples"]
    assert (
        project.call_model("textsql_model", {"accessKey": "wrong", "request": example["request"]})["success"] is False
    )
    before = project.call_model("textsql_model", {"accessKey": key, "request": example["request"]})
    assert before["success"] and "no trained model" in before["response"]["error"]

    save_tiny_model(run_dir / "model")
    answered = project.call_model("textsql_model", {"accessKey": key, "request": example["request"]})
    assert answered["success"], answered
    response = answered["response"]
    assert {"sql", "query"} <= set(response) and response["query"] is not None, answered
    assert "answer" in response or "does not run over these rows" in response["error"], answered
    json.dumps(answered)  # the endpoint's response is JSON
