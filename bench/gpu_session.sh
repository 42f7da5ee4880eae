#!/usr/bin/env bash
# One GPU session in one command of at most 10 minutes (bench/gpu_session.py): the environment check, attention,
# end-to-end training with a profile, the optimizer step and the CUDA tests, into $OUT/report.md, report.json and
# session.log (OUT defaults to runs/gpu), the report printed last.
#   SYMGPT_COMMIT=$(git rev-parse HEAD) timeout 590 bash bench/gpu_session.sh
#   PYTHON=/opt/torch/.venv/bin/python3 bash bench/gpu_session.sh --only attention cuda_tests
# The driver needs only a python3 (standard library); the steps run under $PYTHON, else the first of python3,
# python whose torch sees CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
for driver in python3 python; do
    if command -v "$driver" >/dev/null 2>&1; then
        exec "$driver" -m bench.gpu_session "$@"
    fi
done
echo "bench/gpu_session.sh: neither python3 nor python is on PATH; install Python 3 or add it to PATH" >&2
exit 2
