"""Sample text from a trained model, with the mean biases of evaluation (docs/export.md#sampling).

    python -m sample --checkpoint runs/NAME --prompt "The meaning of life is" --max-new-tokens 100
    python -m sample --checkpoint gpt2.pt --num-samples 3 --temperature 0.8 --top-k 200 --seed 1

--checkpoint (or --run) takes a run directory (its checkpoints/latest.pt), a checkpoint file, or a directory written
by `python -m export to-hf` (model.safetensors + config.json). Generation keeps a KV cache (`generate`).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

import export
import kv_cache
import train_gpt
from cli import ArgumentParser, add_model_flag
from data.shards import EOT_TOKEN, GPT2_VOCAB
from fileio import exits_on_filesystem_errors
from run.checkpoint import CheckpointError, non_finite_weights
from run.process import resolve_device


@torch.no_grad()
def generate(model: train_gpt.GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, vocab_limit: int | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True) -> torch.Tensor:
    """Continue each row of idx (B, T) by max_new_tokens tokens sampled from `model` with the mean biases, as nanoGPT
    does: the context is cropped to block_size, logits are divided by `temperature` (0: greedy) and cut to the
    `top_k` most likely tokens. `vocab_limit` samples only ids below it, e.g. the tokenizer's 50257 when the
    vocabulary is padded. A KV cache reads each token once while the context fits block_size (standard attention,
    use_cache); past it, and without the cache, every token reruns the window (docs/export.md#sampling)."""
    if model.config.objective != "clm":
        raise ValueError(f"this model was trained with --objective {model.config.objective}: it predicts masked "
                         "tokens from both sides, not the next token, so it cannot generate text")
    cache = kv_cache.for_model(model.config) if use_cache else None
    for _ in range(max_new_tokens):
        if idx.size(1) > model.config.block_size:
            cache = None  # positions are absolute: once the context outgrows them, each token reruns the window
        context = idx[:, -model.config.block_size:] if cache is None else idx[:, cache.length:]
        logits = model(context, cache=cache)[0][:, -1, :vocab_limit].float()
        if temperature == 0:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat((idx, next_token), dim=1)
    return idx


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(module="sample", description=__doc__.split("\n\n")[0],
                            epilog=__doc__.split("\n\n", 1)[1])
    add_model_flag(parser)
    parser.add_argument("--prompt", default="", help="text to continue (default: start after <|endoftext|>)")
    parser.add_argument("--prompt-file", type=Path, default=None,
                        help="read the prompt from this UTF-8 text file instead")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens generated per sample")
    parser.add_argument("--num-samples", type=int, default=1, help="independent samples (one batch)")
    parser.add_argument("--temperature", type=float, default=export.SAMPLING_DEFAULTS["temperature"],
                        help="softmax temperature; 0 is greedy decoding")
    parser.add_argument("--top-k", type=int, default=export.SAMPLING_DEFAULTS["top_k"],
                        help="sample among the K most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=1337, help="seed of the sampling generator")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where to run")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                        help="auto: bf16 autocast on CUDA, fp32 on the CPU")
    return parser


def input_problem(args: argparse.Namespace) -> str | None:
    """The first bad flag value, phrased as what to change; None when all are valid."""
    if args.max_new_tokens < 1:
        return f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"
    if args.num_samples < 1:
        return f"--num-samples must be >= 1, got {args.num_samples}"
    if not 0 <= args.temperature < math.inf:
        return f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}"
    if not 0 <= args.seed <= 2**32 - 1:
        return f"--seed must be in [0, 4294967295], got {args.seed}"
    if args.top_k < 0:
        return f"--top-k must be >= 0 (0: no cut), got {args.top_k}"
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            return f"--prompt-file {args.prompt_file}: no such file"
        try:
            read_prompt(args)
        except UnicodeDecodeError as exc:
            return (f"--prompt-file {args.prompt_file}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it "
                    "as UTF-8")
        except OSError as exc:
            return f"--prompt-file {args.prompt_file}: cannot be read ({exc.strerror})"
    if args.dtype == "bf16" and args.device == "cpu":
        return "--dtype bf16 runs on CUDA only (use --dtype fp32 on the CPU)"
    return None


def read_prompt(args: argparse.Namespace) -> str:
    return args.prompt_file.read_text(encoding="utf-8") if args.prompt_file is not None else args.prompt


def sample(args: argparse.Namespace) -> list[str]:
    """The generated continuations (prompt excluded), one string per sample."""
    from data.tokenizer import gpt2_tokenizer

    device = resolve_device(args.device)
    try:
        model = export.load_model(args.checkpoint).to(device)
    except (export.ExportError, CheckpointError) as exc:
        raise SystemExit(f"error: {exc}") from None
    if problem := non_finite_weights(model.state_dict()):
        print(f"warning: {args.checkpoint}: {problem}: the run had diverged, and the text below means nothing",
              file=sys.stderr)
    encoding = gpt2_tokenizer()
    prompt = read_prompt(args)
    tokens = encoding.encode(prompt, allowed_special={"<|endoftext|>"}) if prompt else [EOT_TOKEN]
    if max(tokens) >= model.config.vocab_size:
        raise SystemExit(f"error: the prompt has token id {max(tokens)}, beyond this model's vocabulary of "
                         f"{model.config.vocab_size}")
    if len(tokens) > model.config.block_size:
        print(f"note: the prompt has {len(tokens)} tokens; the model sees the last {model.config.block_size} "
              "(its block_size)", file=sys.stderr)
    idx = torch.tensor([tokens] * args.num_samples, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    use_bf16 = device.type == "cuda" and args.dtype in ("auto", "bf16")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16):
            out = generate(model, idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                           vocab_limit=min(model.config.vocab_size, GPT2_VOCAB), generator=generator)
    except RuntimeError:  # torch.multinomial refuses the probabilities that non-finite weights reached
        if not problem:
            raise
        raise SystemExit(f"error: {args.checkpoint}: {problem}, and they reach the next token's probabilities: no "
                         "text can be sampled") from None
    return [encoding.decode(row[len(tokens):].tolist()) for row in out]


@exits_on_filesystem_errors("location")
def main(argv: list[str] | None = None) -> list[str]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if problem := input_problem(args):
        parser.error(problem)
    texts = sample(args)
    prompt = read_prompt(args)
    for text in texts:
        print(prompt + text)
        print("-" * 40)
    return texts


if __name__ == "__main__":
    main()
