"""The learning check: the product's own pipeline teaches the small T5 to read a table's header.

Nothing else on a CPU tells a working pipeline from a broken one: a model from random weights trained on
the real sample stays at the trivial baseline either way. Here the commands docs/explanation/learning-check.md
shows run as written: ``textsql prepare`` writes the quick synthetic source (``synthetic-select``: 12,000
questions without conditions over 3,000 recombined four-column tables) in the ``uncased`` form, ``textsql train``
trains one DeepSpeed rank, and ``textsql infer`` answers the held-out questions, whose 15 real headers hold column
names training never saw. Writing the right query over such a table takes reading its header from the input:
given another table's header, the model still finds the column a question names part of the time (the grammar
offers only this table's columns), but far less often writes the whole query right.

Shown when the check was written (figures below, and in the closing note of issue 28): a loss whose targets are
shifted by one token, or each question given another table's header, fails it.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TEXTSQL = Path(sys.executable).with_name("textsql")
PAGE = Path(__file__).resolve().parent.parent / "docs" / "explanation" / "learning-check.md"
STEPS = 700
# Measured 2026-11-25 on this project's 2-core machine (batch 64, 700 steps, 1 min 57 s for the whole test), on the
# 200 held-out questions: select 0.485 against the first-column baseline 0.170, logical form 0.415 against 0.160.
# Broken on purpose: the loss comparing each position's output with the next position's target gave select
# 0.400, logical form 0.000; each question given the next question's (another table's) header gave 0.340 and
# 0.260. Grammar-constrained decoding still writes a column the question names, so select alone moves little.
# The learning rate decays linearly here, not held constant as TRAINING_DEFAULTS holds it: constant, the model
# learns more (select 0.650, logical form 0.570), but so does the model given other tables' headers (0.515 and
# 0.440, past both margins), while the shifted loss still fails (0.475 and 0.025). Decaying, the right run clears
# the margins by 0.115 and 0.105, and the other-header run misses them by 0.03 and 0.05.
SELECT_MARGIN = 0.20
QUERY_MARGIN = 0.15
RUN_TIMEOUT_S = 600


def page_commands() -> list[list[str]]:
    """The shell block under "What it runs" in docs/explanation/learning-check.md, one argv per command."""
    block = PAGE.read_text().split("## What it runs", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in re.sub(r"\\\n\s*", "", block).splitlines() if line.strip()]


def test_the_pages_commands_teach_the_small_t5_to_read_a_header(tmp_path):
    """The three commands of the page, run as written (from a project whose runs/ is tmp_path's)."""
    commands = page_commands()
    assert [words[:2] for words in commands] == [[".venv/bin/textsql", verb] for verb in ("prepare", "train", "infer")]
    for words in commands:
        result = subprocess.run(
            [str(TEXTSQL), *words[1:]],
            check=False,
            cwd=tmp_path,
            env=os.environ | {"PYTHONUNBUFFERED": "1"},
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        assert result.returncode == 0, (shlex.join(words), (result.stdout + result.stderr)[-6000:])
    run = tmp_path / "runs" / "check"
    summary = json.loads((run / "run.json").read_text())
    assert summary["global_step"] == STEPS and summary["loss_vocabulary"] == "batch"

    metrics = json.loads((run / "metrics.json").read_text())
    selected, first_column = metrics["components"]["sel"], metrics["baseline"]["components"]["sel"]
    exact, trivial = metrics["lf_accuracy"], metrics["baseline"]["lf_accuracy"]
    assert selected >= first_column + SELECT_MARGIN and exact >= trivial + QUERY_MARGIN, (
        f"held-out select accuracy {selected:.3f} (first-column baseline {first_column:.3f}), logical form {exact:.3f} "
        f"(baseline {trivial:.3f}): the model did not learn to read the header (targets misaligned with the "
        "model's outputs, or another table's header in the input?)"
    )
