#!/usr/bin/env bash
# Quick start 2: run the whole test suite (unit, integration, end-to-end), the vLLM engine backend's
# tests included (so vLLM is installed too). Extra arguments go to pytest (e.g. -k engine, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --vllm
# The vLLM backend's tests, the tests with SMG in front of an engine and the Node.js client's tests
# must run here, not skip: a missing vLLM, smg (the test extra installs it) or node/npm is a failure.
export TITO_REQUIRE_VLLM=1
export TITO_REQUIRE_SMG=1
export TITO_REQUIRE_NODE=1
# Two test processes (pytest-xdist), each taking whole test files (their module-scoped servers are
# started once): much of the suite waits on servers and engines starting, so two processes share
# the 2 CPUs CI has. `-n 0` runs everything in one process.
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
