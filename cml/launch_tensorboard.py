"""CML application: TensorBoard on every run's event files, at the application's port."""

import os

from textsql.constants import PROJECT_DIR
from textsql.display.tensorboard import serve_forever

serve_forever(os.environ.get("TEXTSQL_TENSORBOARD_LOGDIR", str(PROJECT_DIR / "runs")))
