"""End-to-end training throughput of a preset on the available device: tokens/s, step time, MFU.

    python -m bench.e2e --preset gpt2-124m --steps 60            # CUDA: bf16 + torch.compile
    python -m bench.e2e --preset smoke --steps 30                # CPU
    python -m bench.e2e --preset gpt2-124m --optimizer sgdm -- --micro-batch 16   # flags after -- go to train_gpt
    python -m bench.e2e --preset gpt2-124m -- --attention-impl sdpa              # one attention implementation
    python -m bench.e2e --preset gpt2-124m --steps 30 -- --profile-steps 26:28   # and a profile of two steps
    torchrun --nproc_per_node=2 -m bench.e2e --preset smoke --optimizer ecd -- --no-overlap-reduce   # 2 ranks

Runs the real training loop (train_gpt.main) on random tokens written to a temporary shard, so it measures the
model, the optimizer, the loader and the loop together. The first `--warmup` logged intervals (compilation,
allocator warm-up) are excluded from the steady-state figures, and so is an interval that overlaps a
`--profile-steps` window (whose summary, host and device time per step and the top kernels, goes into the JSON).
The run ends without the final checkpoint and validation unless `--final`. MFU uses the datasheet dense bf16 peak of
the GPU. The JSON also holds the last timed training loss, the log's lines about a CUDA graph (--compile-mode), the
peak GPU memory the run reserved, and every log record's (wall time, step, tokens), which line up runs that share a
GPU (bench/throughput.py).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import train_gpt
from cli import ArgumentParser
from config import PRESETS
from data.shards import write_shard
from fileio import atomic_write, exits_on_filesystem_errors
from run.log import read_log
from run.process import world_size_from_env


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(module="bench.e2e", description=__doc__)
    parser.add_argument("--preset", default="gpt2-124m", choices=sorted(PRESETS), help="the model and batch to time")
    parser.add_argument("--optimizer", default="adamw", help="optimizer of the timed steps")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to run")
    parser.add_argument("--log-every", type=int, default=5, help="steps per timed interval")
    parser.add_argument("--warmup", type=int, default=2, help="timed intervals to discard")
    parser.add_argument("--final", action="store_true",
                        help="also write the final checkpoint and run the final validation (a 124M model's "
                             "checkpoint is 1.5 GB)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args, passthrough = parser.parse_known_args(argv)
    passthrough = [a for a in passthrough if a != "--"]
    load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    warning = busy_warning(load, cores)
    if warning:
        print(warning, file=sys.stderr)

    cfg = train_gpt.parse_config(["--preset", args.preset, "--optimizer", args.optimizer, *passthrough])
    hp = cfg.train
    tokens_needed = (args.steps + 2) * hp.batch_tokens + hp.seq_len + 1
    with tempfile.TemporaryDirectory() as tmp:  # under torchrun every rank writes the same shard into its own
        rng = np.random.default_rng(0)
        write_shard(Path(tmp) / "bench_train_000001.bin", rng.integers(0, 50257, tokens_needed, dtype=np.uint16))
        summary = train_gpt.main([
            "--preset", args.preset, "--optimizer", args.optimizer, "--steps", str(args.steps),
            "--train-files", str(Path(tmp) / "bench_train_*.bin"), "--val-every", "0",
            "--val-tokens", str(hp.micro_batch * hp.seq_len * world_size_from_env()),
            "--log-every", str(args.log_every), "--checkpoint-every", "0",
            "--run-dir", tmp, "--run-name", "bench", *passthrough,
        ], final=args.final)
        if summary["run_dir"] is None:  # not the master rank: it has nothing to report
            return
        records = read_log(summary["run_dir"])
        attention = json.loads((Path(summary["run_dir"]) / "config.json").read_text())["attention"]
        notes = [line for line in (Path(summary["run_dir"]) / "log.txt").read_text().splitlines()
                 if line.startswith(("CUDA graph:", "--compile-mode"))]
    profile = next((r["profile"] for r in records if "profile" in r), None)
    timed = steady_intervals(records, args.warmup, profile["steps"] if profile else None)
    if not timed:
        raise SystemExit("no timed intervals left after warm-up: raise --steps or lower --warmup")
    tok_s = statistics.median(r["tokens_per_s"] for r in timed)
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    result = {
        "preset": args.preset, "optimizer": args.optimizer, "device": summary_device(),
        "world_size": world_size_from_env(), "parameters": count_parameters(cfg.model),
        "batch_tokens": hp.batch_tokens, "steps": args.steps, "tokens_per_s": tok_s,
        "step_time_ms": 1000 * hp.batch_tokens / tok_s, "mfu": statistics.median(mfus) if mfus else None,
        "passthrough": passthrough, "final_val_loss": summary["val_loss"] if args.final else None,
        "train_loss": timed[-1]["train_loss"], "attention": attention, "graph": notes, "profile": profile,
        "peak_memory_gib": torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None,
        "records": [[r["wall_time"], r["step"], r["tokens"]] for r in records if "tokens_per_s" in r
                    and not r.get("summary")],
        "load_average_before": load, "cores": cores,
    }
    print(f"\n{'preset':>12} {'optimizer':>9} {'device':>24} {'ranks':>5} {'attention':>9} {'tokens/s':>12} "
          f"{'step ms':>9} {'MFU':>6}")
    mfu = f"{100 * result['mfu']:.1f}%" if result["mfu"] else "n/a"
    print(f"{args.preset:>12} {args.optimizer:>9} {result['device'][:24]:>24} {result['world_size']:>5} "
          f"{str(attention['choice']):>9} {tok_s:>12,.0f} {result['step_time_ms']:>9.1f} {mfu:>6}")
    if args.out:
        atomic_write(args.out, json.dumps(result, indent=2).encode())
    if warning:
        print(warning, file=sys.stderr)  # again under the numbers it qualifies


def busy_warning(load: float, cores: int) -> str | None:
    """A warning when other work competes for the cores (1-minute load average above their number): the timing
    then measures the machine's load as much as the trainer."""
    if load <= cores:
        return None
    return (f"WARNING: this machine is busy (load average {load:.1f} on {cores} cores, before this benchmark): its "
            "numbers are slower than on an idle machine and do not compare with other runs; rerun when the load is "
            f"below {cores}")


def steady_intervals(records: list[dict], warmup: int, profiled: list[int] | None) -> list[dict]:
    """The training log records after the first `warmup`, less any whose interval (the steps since the record
    before) overlaps the profiled steps [first, last]."""
    training = [r for r in records if "tokens_per_s" in r and not r.get("summary")]
    intervals = list(zip([{"step": -1}] + training, training))[warmup:]
    return [record for before, record in intervals
            if profiled is None or record["step"] < profiled[0] or before["step"] >= profiled[1]]


def count_parameters(model_cfg: train_gpt.GPTConfig) -> int:
    with torch.device("meta"):
        return train_gpt.GPT(model_cfg).get_num_params()


def summary_device() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


if __name__ == "__main__":
    main()
