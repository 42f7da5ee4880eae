#!/usr/bin/env bash
# Quickstart:  ./run.sh            set up what is missing, then train (see README.md)
#              ./run.sh test       run the test suite
# Extra arguments pass through: to train_gpt.py (`./run.sh --steps 50`) or to pytest (`./run.sh test -k loader`).
set -euo pipefail
cd "$(dirname "$0")"
VENV="${SYMGPT_VENV:-.venv}"
TORCH_CPU="2.13.0+cpu"            # the CPU build: never pulls CUDA wheels
TRITON_VERSION="3.6.0"            # only installed when no triton is present (torch's own CUDA build brings one)

have_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "[setup] creating virtualenv $VENV (system site-packages visible, so an installed torch is reused)"
        python3 -m venv --system-site-packages "$VENV"
    fi
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
    local pip="python -m pip install -q --disable-pip-version-check"
    if ! python -c "import torch" 2>/dev/null; then
        if have_cuda; then
            echo "[setup] installing torch (CUDA build) — a GPU is present"
            $pip "torch>=2.11,<2.14"
        else
            echo "[setup] installing torch $TORCH_CPU (CPU build)"
            $pip "torch==$TORCH_CPU" 2>/dev/null || \
                $pip "torch==$TORCH_CPU" --index-url https://download.pytorch.org/whl/cpu \
                    --extra-index-url https://pypi.org/simple
        fi
    fi
    if ! python -c "import triton" 2>/dev/null; then
        echo "[setup] installing triton $TRITON_VERSION (CPU interpreter for the kernel tests)"
        $pip "triton==$TRITON_VERSION"
    fi
    if ! python -c "import numpy, tiktoken, tqdm, huggingface_hub, matplotlib, scipy, pytest, xdist, pyarrow, safetensors, transformers
from setuptools.command import bdist_wheel" 2>/dev/null; then
        echo "[setup] installing requirements.txt"
        $pip -r requirements.txt
    fi
    python -m data.tokenizer >/dev/null  # fetch + verify the GPT-2 BPE ranks once (docs/data.md#shard-format)
}

setup
if [ "${1:-}" = "test" ]; then
    shift
    set +e
    python -m pytest -q -n auto --dist loadgroup "$@"  # a worker per core; `serial` tests on one (tests/conftest.py)
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then
        echo "pytest collected no tests (exit code 5): check the test selection" >&2
    fi
    exit "$rc"
fi

if have_cuda; then
    gpus=$(nvidia-smi -L | wc -l)
    if ! python -c "from data.fineweb_edu import fineweb_shards_present as p; raise SystemExit(0 if p() else 1)"; then
        echo "[data] FineWeb-Edu shards missing: downloading val + ${FINEWEB_CHUNKS:-6} x 100M train tokens"
        python -m data.fineweb_edu --chunks "${FINEWEB_CHUNKS:-6}" || echo "[data] download failed: training on the embedded corpus instead"
    fi
    # The trainer splits the paper's batch of 8 sequences over the GPUs; when 8 does not divide, use 8 per GPU.
    batch=()
    if [ $((8 % gpus)) -ne 0 ]; then
        batch=(--batch-tokens $((gpus * 4096)))
        echo "[train] 8 sequences do not split over $gpus GPUs: using 8 per GPU (--batch-tokens $((gpus * 4096)))"
    fi
    echo "[train] gpt2-124m on $gpus GPU(s)"
    exec torchrun --standalone --nproc_per_node="$gpus" train_gpt.py --preset gpt2-124m "${batch[@]}" "$@"
fi
echo "[train] no CUDA: smoke preset on the CPU (embedded corpus)"
exec python train_gpt.py --preset smoke "$@"
