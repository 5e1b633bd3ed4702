"""CML session task: install the pinned requirements (the project itself included, with `-e .`)."""
import subprocess
import sys
from pathlib import Path

requirements = Path(__file__).resolve().parent.parent / "requirements.txt"
subprocess.run([sys.executable, "-m", "pip", "install", "--progress-bar", "off", "-r", str(requirements)], check=True)
