#!/usr/bin/env bash
# Creates .venv and installs tito with its test extras, once per version of pyproject.toml.
# torch==2.13.0 is installed first and on its own so that pip picks the CPU build instead of
# pulling a multi-GB CUDA build as a dependency of something else.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "tito needs Python >= 3.11; set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=".venv/.tito-installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "installing tito and its dependencies into .venv (first run only) ..." >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[test]"
  rm -f .venv/.tito-installed-*
  touch "$stamp"
fi
