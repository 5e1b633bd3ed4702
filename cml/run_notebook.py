"""CML job: run one of the project's notebooks headless with papermill.

Argument: the notebook (01_prepare_dataset, 02_train_distributed or 03_inference). Each parameter of
the notebook can be set as TEXTSQL_<PARAMETER> in the project's or the job's environment; relative
paths there (data_dir, run_dir, model_dir, and a model, source or real_source that is a directory of
the project) are relative to the project root, as everything else in CML is, although the kernel runs
in notebooks/. The executed copy is written to runs/jobs/<notebook>-<time>.ipynb, to open from the Files
tab. A failing cell, a wrong parameter, or a runtime without what training needs (pdsh, sshd: checked
before any worker starts) ends the job with one line saying which, not a traceback.
"""

import logging
import sys
import time

from textsql.constants import PROJECT_DIR
from textsql.errors import TextSQLError
from textsql.launching.preflight import TRAIN, missing_for
from textsql.notebook_parameters import job_parameters, parameters_from_environ
from textsql.notebook_runs import run_notebook, runtime_checks

logging.basicConfig(level=logging.INFO, format="%(message)s")  # the cells' output, live, in the job's log
name = sys.argv[1]
output = PROJECT_DIR / "runs" / "jobs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.ipynb"
try:
    if name == "02_train_distributed":
        missing = missing_for(runtime_checks(job_parameters()), [TRAIN])
        if missing:
            sys.exit(
                "Error: this runtime cannot train: " + "; ".join(f"{check.name}: {check.detail}" for check in missing)
            )
    run_notebook(name, output, parameters_from_environ(name))
except TextSQLError as error:
    sys.exit(f"Error: {error}")
