#!/usr/bin/env bash
# One command sets everything up: a virtual environment in .venv with torch, autofit and its
# test dependencies, and (where apt-get runs as root) Debian's PostgreSQL server for the
# multi-worker test. TORCH_VERSION picks another torch build (default 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build
python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[test]"
# liger-kernel without its triton requirement: on a machine without a GPU, `liger=on` is then
# `unsupported` for the real reason (no triton), as a user's CPU install would see it; on a GPU
# host, `pip install 'autofit[kernels]'` brings both
python -m pip install -q --no-deps "liger-kernel==0.8.5"
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi
echo "set up: . .venv/bin/activate && autofit --help"
