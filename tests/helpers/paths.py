"""Where the project, its test emulators and the shared real data are."""

from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[2]
SHARED_DATA_DIR = PROJECT_DIR.parent / "shared" / "data"
FAKES = PROJECT_DIR / "tests" / "fakes"  # emulators of what cannot run here (cml.workers_v1, a Kubernetes API server)
