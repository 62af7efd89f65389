#!/usr/bin/env bash
# Quick start 1: start render, engine and derender on the embedded demo model (tito-demo, trained
# offline on first use) and stream a chat with a generated red square image through them. Extra
# arguments go to `tito chat` (e.g. --image photo.png, --no-thinking, --max-tokens 32).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
text=${1:-"Hello! What can you do?"}
shift || true
exec .venv/bin/tito chat "$text" "$@"
