#!/usr/bin/env bash
# One session on a GPU machine: correctness first, then every benchmark.
# Results go to $OUT (if set) or runs/gpu. Record the tables in BENCHMARKS.md.
#   bash bench/gpu_session.sh
# The tokenizer tests need data/cache/tiktoken (copy it along to a GPU machine without network access).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ nvidia-smi; git rev-parse --short HEAD 2>/dev/null; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"
{ time python -m pytest -q -m cuda tests/; } 2>&1 | tee "$OUT/cuda_tests.txt"  # cold start: the goal is <= 90 s
{
    python -m bench.attention --out "$OUT/attention.json"                                  # the shipped tiles
    SYMGPT_ATTENTION_AUTOTUNE=1 python -m bench.attention --out "$OUT/attention_autotuned.json"  # to update TILES
} 2>&1 | tee "$OUT/attention.txt"
{  # the paper's 8 x 512 batch with AdamW and ECD (b_Q + b_V, the default bias mode), then a 32K-token batch
    python -m bench.e2e --preset gpt2-124m --steps 60
    python -m bench.e2e --preset gpt2-124m --optimizer ecd --steps 60
    python -m bench.e2e --preset gpt2-124m --steps 40 -- --micro-batch 64 --batch-tokens 32768
} 2>&1 | grep -v "^step " | tee "$OUT/e2e.txt"
{
    python -m bench.optim --optimizers ecd,ecd:unfused,soap,muon,adamw,sgdm
    python -m bench.optim --optimizers ecd,ecd:unfused --state-dtype bf16
} 2>&1 | tee "$OUT/optim.txt"
python -m bench.sample --device cuda --max-new-tokens 400 --repeats 3 2>&1 | tee "$OUT/sample.txt"  # KV cache
