#!/usr/bin/env bash
# One session on a GPU machine, under 10 minutes on one H100/H200: the CUDA tests, bench.attention, bench.optim and
# bench.e2e with each attention implementation, each step under its own time limit (bench/gpu_session.py).
# Writes $OUT/gpu_session.md and $OUT/gpu_session.json (OUT defaults to runs/gpu), and each step's log beside them.
#   bash bench/gpu_session.sh
#   PYTHON=/path/to/venv/bin/python bash bench/gpu_session.sh --only cuda_tests attention
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m bench.gpu_session "$@"
