"""Validation loss on a fixed token budget (docs/model.md note): the same tokens for every model, mean biases
(docs/model.md).

    python -m eval.val_loss --run runs/NAME [--val-tokens 10485760] [--val-files 'data/x_val_*.bin']

The budget is the first `val_tokens` tokens of the validation stream (`data.loader.validation_batches`: contiguous
sequences in sorted shard order), so every model sees identical data without any randomness. Writes
`val_loss.json`, `val_loss.png` (the run's loss curves with this evaluation marked) and `val_loss.md`, recorded
with the checkpoint in `manifest.json` (docs/evaluation.md#validation-loss).
"""
from __future__ import annotations

import math
import time

import torch

import train_gpt
from cli import ArgumentParser
from data.shards import ShardError
from eval.configuration import run_hyperparameters, validation_files
from eval.curves import loss_figure, loss_series
from eval.figures import save_figure
from eval.outputs import record_outputs, write_json
from eval.target import add_target_args, open_target
from fileio import atomic_write, exits_on_filesystem_errors
from run.log import read_log


def validation_loss(model: train_gpt.GPT, files: str | list[str], num_tokens: int, seq_len: int, micro_batch: int,
                    device: torch.device, autocast_dtype: torch.dtype | None = None) -> dict:
    """The trainer's validation loss (`train_gpt.evaluate`) on one process, with its perplexity and token count."""
    autocast = torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    loss = train_gpt.evaluate(model, files, num_tokens, seq_len, micro_batch, device=device, autocast=autocast)
    return {"val_loss": loss, "perplexity": math.exp(loss), "tokens": num_tokens // seq_len * seq_len,
            "seq_len": seq_len, "micro_batch": micro_batch}


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(module="eval.val_loss", description=__doc__)
    add_target_args(parser)
    parser.add_argument("--val-files", default=None, help="validation shard glob (default: the run's config)")
    parser.add_argument("--val-tokens", type=int, default=None, help="token budget (default: the run's val_tokens)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="default: the run's seq_len (at most the model's block size, for an exported model)")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the run's micro_batch")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="autocast dtype on CUDA")
    args = parser.parse_args(argv)
    target = open_target(args)
    run_dir, ckpt_path, ckpt, out, device = (target.run_dir, target.checkpoint_path, target.checkpoint, target.out,
                                             target.device)
    hp = run_hyperparameters(ckpt["config"])
    files = args.val_files or validation_files(ckpt["config"])
    model = train_gpt.model_from_checkpoint(ckpt).to(device)
    block_size = model.config.block_size  # an exported model records no run, hence no seq_len of its own
    seq_len, micro_batch = args.seq_len or min(hp.seq_len, block_size), args.micro_batch or hp.micro_batch
    num_tokens = args.val_tokens or hp.val_tokens
    if not 0 < seq_len <= block_size:
        parser.error(f"--seq-len {seq_len}: the model reads 1 to {block_size} positions (its block size); give "
                     f"--seq-len {block_size} or less")
    if num_tokens < seq_len:
        parser.error(f"--val-tokens {num_tokens} is less than one sequence of --seq-len {seq_len}")
    if micro_batch < 1:
        parser.error(f"--micro-batch must be >= 1, got {micro_batch}")
    dtype = torch.bfloat16 if device.type == "cuda" and args.dtype == "bf16" else None
    start = time.perf_counter()
    try:
        result = validation_loss(model, files, num_tokens, seq_len, micro_batch, device, dtype)
    except ShardError as exc:  # shards missing, malformed or too small for the budget: the message names them
        raise SystemExit(f"error: {exc}") from None
    result.update(checkpoint=target.identity, step=target.identity["step"], val_files=files,
                  seconds=time.perf_counter() - start, dtype="bf16" if dtype is not None else "fp32")
    write_json(out / "val_loss.json", result)
    log = read_log(run_dir)
    tokens = ckpt["metrics"]["tokens"]
    x = tokens if loss_series(log).x == "tokens" and tokens is not None else result["step"] or 0
    save_figure(loss_figure(log, (x, result["val_loss"]), f"{run_dir.name} — step {result['step']}"),
                out / "val_loss.png")
    atomic_write(
        out / "val_loss.md",
        (f"# Validation loss — {run_dir.name}, step {result['step']}\n\n"
        f"- checkpoint `{ckpt_path}` (step {result['step']})\n"
        f"- **val loss {result['val_loss']:.4f}** (perplexity {result['perplexity']:.2f}) on the first "
        f"{result['tokens']:,} tokens of `{files}` (seq_len {seq_len}, {result['dtype']}, mean biases)\n\n"
        "![loss curves](val_loss.png)\n").encode())
    record_outputs(out, "val_loss", target.identity, ["val_loss.json", "val_loss.png", "val_loss.md"])
    print(f"val_loss {result['val_loss']:.4f} on {result['tokens']:,} tokens -> {out / 'val_loss.json'}")
    return result


if __name__ == "__main__":
    main()
