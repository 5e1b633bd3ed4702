"""Hostfiles we write are the ones DeepSpeed's own launcher reads; bad ones fail here first."""

from __future__ import annotations

import pytest

from worker.errors import HostfileError
from worker.hostfile import format_hostfile, parse_hostfile, read_hostfile, write_hostfile

ENTRIES = [("127.0.0.2", 1), ("10.42.0.17", 8), ("gpu-node-3.example.com", 4)]


def test_round_trip_through_deepspeeds_parser(tmp_path):
    from deepspeed.launcher.runner import fetch_hostfile

    path = write_hostfile(tmp_path / "hostfile", ENTRIES)
    assert path.read_text() == "127.0.0.2 slots=1\n10.42.0.17 slots=8\ngpu-node-3.example.com slots=4\n"
    ours = read_hostfile(path)
    theirs = fetch_hostfile(str(path))
    assert list(ours.items()) == list(theirs.items()) == ENTRIES


@pytest.mark.parametrize(
    "text",
    [
        "# comment\n\n127.0.0.2 slots=2\n",
        "  127.0.0.2   slots=2  \n127.0.0.3\tslots=1\n",
    ],
)
def test_comments_and_spacing_read_like_deepspeed(text):
    from deepspeed.launcher.runner import _parse_hostfile

    assert parse_hostfile(text) == dict(_parse_hostfile(text.splitlines()))


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "lists no hosts"),
        ("# only a comment\n", "lists no hosts"),
        ("a slots=1\na slots=2\n", "hostfile:2: 'a' appears twice"),
        ("a slots=x\n", "hostfile:1: bad line 'a slots=x'; expected 'HOST slots=N'"),
        ("a\n", "bad line 'a'"),
        ("a slots=2 gpus=3\n", "bad line"),
        ("a slots=0\n", "has 0 slots"),
    ],
)
def test_bad_hostfiles_are_refused(text, message):
    with pytest.raises(HostfileError, match=message):
        parse_hostfile(text)


def test_deepspeed_refuses_what_we_refuse_for_duplicates_and_empty_files():
    from deepspeed.launcher.runner import _parse_hostfile

    for text in ("", "a slots=1\na slots=2\n", "a slots=x\n"):
        with pytest.raises(ValueError):
            _parse_hostfile(text.splitlines())


@pytest.mark.parametrize(
    "entries, message",
    [
        ([], "no workers"),
        ([("a", 1), ("a", 1)], "appears twice"),
        ([("a b", 1)], "cannot go in a hostfile"),
        ([("a", 0)], "slots 0"),
        ([("a", True)], "slots True"),
    ],
)
def test_writer_refuses_bad_entries_and_writes_nothing(tmp_path, entries, message):
    with pytest.raises(HostfileError, match=message):
        write_hostfile(tmp_path / "hostfile", entries)
    assert list(tmp_path.iterdir()) == []


def test_missing_hostfile_says_what_to_do(tmp_path):
    with pytest.raises(HostfileError, match="does not exist; start the workers first"):
        read_hostfile(tmp_path / "nope")


def test_format_keeps_rank_order():
    assert format_hostfile([("b", 1), ("a", 2)]) == "b slots=1\na slots=2\n"
