"""CML job: run one of the project's notebooks headless with papermill, recorded so the chain can continue.

Arguments: the notebook (01_prepare_dataset, 02_train_distributed or 03_inference), then optionally --resume.
Each parameter of the notebook can be set as TEXTSQL_<PARAMETER> in the project's or the job's environment;
relative paths there (data_dir, run_dir, model_dir, and a model, source or real_source that is a directory of
the project) are relative to the project root, as everything else in CML is, although the kernel runs in
notebooks/. The executed copy is written to runs/jobs/<notebook>-<time>.ipynb (TEXTSQL_JOBS_DIR, relative to the
project root, names another directory), to open from the Files tab.

Each run is recorded in the chain's run directory (TEXTSQL_RUN_DIR/pipeline.json). With --resume, or
TEXTSQL_RESUME_FROM_CHECKPOINT=auto (notebook 02's own resume_from_checkpoint parameter), a notebook that completed with the same parameters
is skipped in one line, training resumes from its newest complete checkpoint, and a job whose earlier
notebook must run again first (its parameters changed, or it did not complete) says which job to start.
A failing cell, a wrong parameter, or a runtime without what training needs (pdsh, sshd: checked before any
worker starts) ends the job with one line saying which, not a traceback.
"""

import logging
import os
import sys
import time

from textsql.constants import PROJECT_DIR
from textsql.errors import TextSQLError
from textsql.launching.preflight import TRAIN, missing_for
from textsql.pipeline.manifest import Manifest, chain_run_dir
from textsql.pipeline.parameters import NOTEBOOKS, job_parameters, notebook_path, parameters_from_environ
from textsql.pipeline.runs import continuation_plan, run_recorded, runtime_checks

logging.basicConfig(level=logging.INFO, format="%(message)s")  # the cells' output, live, in the job's log
# Where the executed copies go; an absolute TEXTSQL_JOBS_DIR stays as it is (a path joined to an absolute one).
JOBS_DIR = PROJECT_DIR / os.environ.get("TEXTSQL_JOBS_DIR", "runs/jobs")
output = JOBS_DIR / f"{sys.argv[1]}-{time.strftime('%Y%m%d-%H%M%S')}.ipynb"
try:
    name = notebook_path(sys.argv[1]).stem
    chosen = job_parameters()
    run_dir = chain_run_dir(chosen)
    manifest, step, first = Manifest.load(run_dir), None, None
    if "--resume" in sys.argv[2:] or chosen["02_train_distributed"]["resume_from_checkpoint"] == "auto":
        manifest, steps = continuation_plan(run_dir, chosen)
        step = steps[name]
        if not step.runs:
            print(f"{name} skipped: {step.reason}")
            sys.exit(0)
        first = next((other for other in NOTEBOOKS[: NOTEBOOKS.index(name)] if steps[other].runs), None)
    if name == "02_train_distributed":
        missing = missing_for(runtime_checks(chosen), [TRAIN])
        if missing:
            sys.exit(
                "Error: this runtime cannot train: " + "; ".join(f"{check.name}: {check.detail}" for check in missing)
            )
    if first is not None:
        sys.exit(f"Error: {first} must run first ({steps[first].reason}); start its job, then this one")
    if step is not None:
        print(f"{name} runs: {step.reason}")
    manifest.begin()
    run_recorded(manifest, name, output, parameters_from_environ(name), step)
except TextSQLError as error:
    sys.exit(f"Error: {error}")
