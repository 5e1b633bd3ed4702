#!/usr/bin/env bash
# One command for a GPU machine without network, run from the repository root of a copy of the tree:
#
#   bash bench/device.sh OUT_DIR            (install from the copied bench/wheels, measure, write into OUT_DIR)
#   bash bench/device.sh --dry-run OUT_DIR  (check and say what would be installed; install and run nothing)
#
# Prints the Python, torch, CUDA and the GPU; installs only what the machine lacks of bench/gpu-requirements.txt,
# only from the wheels in bench/wheels/ (make gpu-wheels, on a connected machine), keeping the machine's own torch;
# then runs `python -m bench gpu-quick` (process_wall_s in bench/gpu_quick.json says how long one H200 took), writing
# its JSON (gpu_quick.json), its log, the ranks' logs (OUT_DIR/logs, kept even when an arm fails) and this script's
# output into OUT_DIR. Everything is sized for one call of at most 9 minutes: gpu-quick gets what is left of BUDGET_S
# (540 s) after the install; it runs its arms most telling first (the defaults, the docs-tuned peer, the old recipe,
# t5-base's shape) and torch.compile's, which compiles for minutes, last and only if the budget still holds it;
# gpu_quick.json is written after each arm, so a run cut short keeps the arms done, and the time spent against
# BUDGET_S is printed after the install, after each arm and at the end, however the script ends.
#
# Environment: PYTHON (default python3, the interpreter that has the machine's torch), WHEELS (default bench/wheels),
# BUDGET_S (default 540), QUICK_ARGS (more gpu-quick arguments: "--device cpu --smoke" rehearses it all on a CPU).
# BENCH_COMMIT ("COMMIT:TREE" of the clean checkout copied here: `echo $(git rev-parse --short HEAD):$(git rev-parse
# HEAD^{tree})`), where the copy's .git may be stale: the JSON then names that commit, and counts as committed only
# if the files here hash to that tree.
set -euo pipefail

dry_run=false
if [[ "${1:-}" == "--dry-run" ]]; then
    dry_run=true
    shift
fi
out="${1:?usage: bash bench/device.sh [--dry-run] OUT_DIR (run from the repository root)}"
python="${PYTHON:-python3}"
wheels="${WHEELS:-bench/wheels}"
budget_s="${BUDGET_S:-540}"
requirements="bench/gpu-requirements.txt"

fail() {
    echo "device.sh: $*" >&2
    exit "${code:-2}"
}

[[ -f "$requirements" ]] || fail "run me from the repository root (no $requirements here)"
mkdir -p "$out"
exec > >(tee "$out/device.log") 2>&1
began=$(date +%s)
trap 'echo "device.sh: $(($(date +%s) - began)) s of the $budget_s s budget"' EXIT

"$python" - <<'EOF' || fail "$python has no torch: this script keeps the machine's own torch and carries none; set PYTHON to the interpreter that has it"
import platform
import shutil

import torch

gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CUDA not available)"
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {gpu}")
# torch.compile's Triton builds its launchers with the system's C compiler: without one the defaults' arm fails.
print(f"C compiler: {shutil.which('cc') or shutil.which('gcc') or 'none'}")
EOF
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi

# Not carried (pyarrow alone is 55 MB): the machine must bring them.
"$python" -c "import numpy, pandas, pyarrow" 2>/dev/null \
    || fail "this machine lacks numpy, pandas or pyarrow, which bench/wheels does not carry; install them from the machine's own index first"

deepspeed_pin=$(grep -E '^deepspeed==' "$requirements" | cut -d= -f3)
compgen -G "$wheels/deepspeed-$deepspeed_pin.tar.gz" >/dev/null \
    || fail "no wheels in $wheels (deepspeed-$deepspeed_pin.tar.gz missing): run \`make gpu-wheels\` on a connected machine and copy $wheels here with the tree"

# --no-index: nothing but the carried files; pip keeps what already satisfies a pin (the machine's torch included:
# no torch is carried, so pip can never replace it). DeepSpeed is an sdist, built without its ops against that torch.
install=("$python" -m pip install --no-index --find-links "$wheels" --no-build-isolation --disable-pip-version-check
    -r "$requirements")
if $dry_run; then
    report=$(DS_BUILD_OPS=0 "${install[@]}" --dry-run)
    grep -v '^Requirement already satisfied' <<<"$report" || true
    grep -q '^Would install' <<<"$report" || echo "device.sh: nothing to install"
    exit 0
fi
started=$SECONDS
DS_BUILD_OPS=0 "${install[@]}" -q
echo "device.sh: install took $((SECONDS - started)) s; $(($(date +%s) - began)) s of the $budget_s s budget"
"$python" -m pip check || echo "device.sh: pip check found the conflicts above (the run goes on)"

left=$((budget_s - ($(date +%s) - began)))
echo "device.sh: gpu-quick gets $left s"
# shellcheck disable=SC2086  # QUICK_ARGS is a list of arguments
PYTHONPATH="$PWD" timeout "$left" "$python" -m bench gpu-quick --out "$out" --budget-s "$budget_s" \
    --budget-start "$began" ${QUICK_ARGS:-} 2>"$out/gpu-quick.log" || {
    code=$?
    tail -n 40 "$out/gpu-quick.log"
    fail "gpu-quick failed with exit code $code (124: out of time); its log is $out/gpu-quick.log"
}
