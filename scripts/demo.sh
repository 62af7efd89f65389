#!/usr/bin/env bash
# Quick start 1: start render, engine and derender on the embedded tiny model and stream a chat
# through them. Extra arguments go to `tito chat` (e.g. --max-tokens 32 --temperature 0.7).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
text=${1:-"Hello! What can you do?"}
shift || true
exec .venv/bin/tito chat "$text" "$@"
