#!/usr/bin/env bash
# Installs the Debian packages the project runs (pdsh for DeepSpeed's launcher, sshd in each local
# worker pod, the ssh client pdsh uses) and, with --dev (`make test`), the headless browser
# tests/test_browser.py drives JupyterLab and TensorBoard with (Debian's chromium and its
# chromedriver, one matching pair, so Selenium needs no download) and Slurm with munge, which
# tests/test_slurm.py starts as a two-node cluster of its own (its own configuration, key and ports; the
# packages' system services are not used). Idempotent; as non-root it only says what is missing.
set -euo pipefail
packages=(pdsh openssh-server openssh-client)
[ "${1:-}" = --dev ] && packages+=(chromium chromium-driver slurm-wlm munge)
missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "missing Debian packages: ${missing[*]}; install them with: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
fi
echo "installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
