#!/usr/bin/env bash
# Quick start 2: run the whole test suite (unit, integration, end-to-end). Extra arguments go to
# pytest (e.g. -k engine, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
