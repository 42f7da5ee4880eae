"""Sampling throughput: tokens per second of `sample.generate` as `python -m sample` calls it, with and without the
KV cache, and whether both give the same tokens.

    python -m bench.sample                                    # smoke and gpt2-124m shapes, CPU
    python -m bench.sample --shapes gpt2-124m --max-new-tokens 100 --repeats 1
    python -m bench.sample --device cuda --max-new-tokens 400     # bf16 autocast, as sample on CUDA

Each shape is a preset's model (random weights from seed 0; the speed does not depend on them) generating
--max-new-tokens after <|endoftext|> (sample's empty prompt) with sample's defaults: temperature 0.8, top-k 200,
seed 1337, the 50257-token vocabulary limit. Reported: the median over --repeats of new tokens per second of the
generate call alone (model loading excluded), and a digest of the generated ids, equal for equal token streams (on
CUDA in bf16 the two paths may round differently and part ways at a near tie).
With the cache, tokens past the block size rerun the whole window (positions are absolute), as without it.
"""
from __future__ import annotations

import contextlib
import hashlib
import statistics
import time

import torch

import config
import sample
import train_gpt
from cli import ArgumentParser
from data.shards import EOT_TOKEN, GPT2_VOCAB
from fileio import exits_on_filesystem_errors


def preset_model(name: str) -> train_gpt.GPT:
    torch.manual_seed(0)
    return train_gpt.GPT(config.config_from_dict(config.PRESETS[name], train_gpt.GPTConfig)).eval()


@exits_on_filesystem_errors("location")
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(module="bench.sample", description=__doc__.split("\n\n")[0],
                            epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--shapes", default="smoke,gpt2-124m", help="comma-separated presets")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens generated per timed call")
    parser.add_argument("--num-samples", type=int, default=1, help="sequences generated together")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (the best is reported)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: under bf16 autocast")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__} | {where} | {args.max_new_tokens} new tokens x {args.num_samples} samples | "
          f"median of {args.repeats}")
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    for name in args.shapes.split(","):
        model = preset_model(name).to(device)
        idx = torch.full((args.num_samples, 1), EOT_TOKEN, dtype=torch.long, device=device)
        for use_cache in (False, True):
            times, digests = [], set()
            for _ in range(args.repeats):
                generator = torch.Generator(device).manual_seed(1337)
                torch.get_device_module(device).synchronize(device)
                start = time.perf_counter()
                with autocast:
                    out = sample.generate(model, idx, args.max_new_tokens, temperature=0.8, top_k=200,
                                          vocab_limit=GPT2_VOCAB, generator=generator, use_cache=use_cache)
                torch.get_device_module(device).synchronize(device)
                times.append(time.perf_counter() - start)
                digests.add(hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest()[:12])
            rate = args.num_samples * args.max_new_tokens / statistics.median(times)
            cfg = model.config
            print(f"{name:>10} ({cfg.n_layer}L {cfg.n_head}H {cfg.n_embd}C, block {cfg.block_size}) "
                  f"{'KV cache' if use_cache else 'no cache':>8}: {rate:8.1f} tokens/s | ids {', '.join(digests)}")


if __name__ == "__main__":
    main()
