"""CML job: run one of the project's notebooks headless with papermill.

Argument: the notebook (01_prepare_dataset, 02_train_distributed or 03_inference). Each parameter of
the notebook can be set as TEXTSQL_<PARAMETER> in the project's or the job's environment. The executed
copy is written to runs/jobs/<notebook>-<time>.ipynb, to open from the Files tab. A failing cell or a
wrong parameter ends the job with one line saying which, not a traceback.
"""
import logging
import sys
import time

from textsql.constants import PROJECT_DIR
from textsql.demo import parameters_from_environ, run_notebook
from textsql.errors import TextSQLError

logging.basicConfig(level=logging.INFO, format="%(message)s")  # the cells' output, live, in the job's log
name = sys.argv[1]
output = PROJECT_DIR / "runs" / "jobs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.ipynb"
try:
    run_notebook(name, output, parameters_from_environ(name))
except TextSQLError as error:
    sys.exit(f"Error: {error}")
