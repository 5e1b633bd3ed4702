"""The library's JSON files (textsql.json_files), tables files (textsql.data.tables), master-private state (textsql.rundir.master_state) and the atomic write under it (worker.files)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from textsql.constants import SAMPLE_DATA_DIR
from textsql.data.tables import load_tables, prepared_tables_path, tables_beside
from textsql.errors import DataError
from textsql.json_files import read_json, read_jsonl, read_jsonl_located, write_json, write_jsonl
from worker.files import atomic_write, last_line


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = atomic_write(tmp_path / "run.json", "old\n")

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("worker.files.os.fsync", no_space)
    with pytest.raises(OSError, match="No space"):
        atomic_write(path, "new\n")
    assert path.read_text() == "old\n"
    assert [entry.name for entry in tmp_path.iterdir()] == ["run.json"]


def test_atomic_write_sets_the_mode_it_is_given(tmp_path):
    secret = atomic_write(tmp_path / "token", "s3cret\n", mode=0o600)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(atomic_write(tmp_path / "plain", "x").stat().st_mode) == 0o644


def test_json_and_jsonl_round_trip_and_create_the_folder(tmp_path):
    items = [{"id": 1, "question": "Wie alt ist Zoë?"}, {"id": 2, "question": "x"}]
    path = write_jsonl(tmp_path / "new" / "predictions.jsonl", items)
    assert list(read_jsonl(path)) == items
    assert "Zoë" in path.read_text(encoding="utf-8")  # kept readable, not \u-escaped
    report = write_json(tmp_path / "deeper" / "metrics.json", {"n": 2, "lf_accuracy": 0.5})
    assert read_json(report) == {"n": 2, "lf_accuracy": 0.5}
    assert report.read_text().endswith("}\n")


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"a": 1}\n\n{"a": 2\n', "lines.jsonl:3: not a JSON object"),
        ('{"a": 1}\n[1, 2]\n', "lines.jsonl:2: a JSON list, not an object"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, text, message):
    path = tmp_path / "lines.jsonl"
    path.write_text(text)
    with pytest.raises(DataError, match="fix or remove the line") as error:
        list(read_jsonl(path))
    assert message in str(error.value)


def test_jsonl_lines_carry_where_they_are_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert list(read_jsonl_located(path)) == [(f"{path}:1", {"a": 1}), (f"{path}:3", {"a": 2})]


def test_missing_and_broken_files_say_which(tmp_path):
    with pytest.raises(DataError, match="missing.jsonl' is not a file"):
        list(read_jsonl(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="missing.json' is not a file"):
        read_json(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text('{\n  "n": \n}')
    with pytest.raises(DataError, match="broken.json:3: not JSON"):
        read_json(tmp_path / "broken.json")


def test_load_tables_fills_defaults_and_checks_each_table(tmp_path):
    path = tmp_path / "dev.tables.jsonl"
    path.write_text(
        json.dumps({"id": "t", "header": ["Name", "Age"]}) + "\n" + json.dumps({"id": "u", "rows": []}) + "\n"
    )
    with pytest.raises(DataError, match="dev.tables.jsonl:2: a table needs an id and a header"):
        load_tables(path)
    path.write_text(json.dumps({"id": "t", "header": ["Name", "Age"], "page_title": "People"}) + "\n")
    assert load_tables(path) == {
        "t": {"id": "t", "header": ["Name", "Age"], "page_title": "People", "types": ["text", "text"], "rows": []}
    }


def test_tables_files_of_both_layouts(tmp_path):
    assert tables_beside(SAMPLE_DATA_DIR / "dev.jsonl") == SAMPLE_DATA_DIR / "dev.tables.jsonl"
    assert tables_beside(tmp_path / "dev.jsonl") is None
    assert prepared_tables_path(tmp_path, "validation") == tmp_path / "tables" / "validation.tables.jsonl"


def test_last_line_of_a_log_quotes_the_failure(tmp_path):
    log = tmp_path / "sshd.log"
    log.write_bytes(b"starting\nfatal: bad config \xff\n\n")
    assert last_line(log) == "fatal: bad config \ufffd"
    log.write_text("")
    assert last_line(log) == "no output"


# ---- JSON a worker can write: bounded, never through a link ---------------------------------------------


def test_a_json_file_planted_as_a_link_is_refused_not_followed(tmp_path):
    secret = tmp_path / "master-only.json"
    secret.write_text('{"token": "do-not-show"}')
    (tmp_path / "cluster.json").symlink_to(secret)
    with pytest.raises(DataError, match=r"cluster.json' is a symbolic link.*remove it"):
        read_json(tmp_path / "cluster.json")


def test_a_json_file_too_large_or_not_a_file_is_refused_in_one_line(tmp_path, monkeypatch):
    import textsql.json_files

    monkeypatch.setattr(textsql.json_files, "MAX_JSON_BYTES", 1024)
    (tmp_path / "run.json").write_text("[" + "0," * 1024 + "0]")
    with pytest.raises(DataError, match=r"run.json' is larger than 1024 bytes"):
        read_json(tmp_path / "run.json")
    # A reader would wait forever on a pipe planted where a file goes.
    os.mkfifo(tmp_path / "collective.json")
    with pytest.raises(DataError, match=r"collective.json' is not a regular file"):
        read_json(tmp_path / "collective.json")
