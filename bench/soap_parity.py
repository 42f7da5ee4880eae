"""Our SOAP against the published SOAP on a GPT: how far apart the two trajectories end, and why.

    python -m bench.soap_parity --published-soap SOAP/soap.py --n-layer 6 --n-head 6 --n-embd 384 --steps 53
    python -m bench.soap_parity --published-soap SOAP/soap.py ... --turn-null-space   # a second published run

Trains `train_gpt.GPT` from the same initialisation with our SOAP (optim/soap.py, its defaults) and with the
published SOAP (the SOAP class of github.com/nikhilvyas/SOAP's soap.py, with the same hyperparameters), each on the
same batches of random tokens (its gradient taken at its own parameters, as in training), and prints the largest
parameter difference and the distance between the two per distance moved. With --turn-null-space it also runs the
published SOAP a second time with one change: the eigenvectors of its first factors' (numerically) zero eigenvalues
are turned by a random rotation within that null space, which is another exact eigendecomposition of the same
factors. When the factors are rank deficient (fewer tokens per step than a rotated side, or rows of the embedding
that no token reached) the basis of that null space is arbitrary, and the two published runs depart from each other
as far as ours departs from the published one: the difference is the choice of null-space basis, not the update
(docs/optimizers.md#soap). tests/test_optim_soap.py shows the same on a small matrix, and that with full-rank
factors ours follows the published SOAP to 1e-9 of the distance moved over 60 steps.
"""
from __future__ import annotations

from pathlib import Path

import torch

import train_gpt
from bench.optim import load_published_soap, published_soap_settings
from cli import ArgumentParser
from optim import OPTIMIZERS
from optim.soap import SOAPConfig
from fileio import exits_on_filesystem_errors


def turned_null_space(published: type) -> type:
    """The published SOAP with the null-space eigenvectors of its first bases turned by a seeded random rotation."""

    class Turned(published):
        def get_orthogonal_matrix(self, factors):
            bases = super().get_orthogonal_matrix(factors)
            gen = torch.Generator().manual_seed(7)
            for factor, q in zip(factors, bases):
                if len(q) == 0:
                    continue
                values = torch.diag(q.T @ factor @ q)  # eigenvalues, q's column order
                null = values.abs() < 1e-6 * values.abs().max()
                if null.sum() > 1:
                    k = int(null.sum())
                    turn = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=q.dtype)).Q.to(q.device)
                    q[:, null] = q[:, null] @ turn
            return bases

    return Turned


def train(model: train_gpt.GPT, optimizer: torch.optim.Optimizer, args) -> None:
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 + step)
        idx = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
        optimizer.zero_grad()
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()


@exits_on_filesystem_errors("location")
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(module="bench.soap_parity", description=__doc__)
    parser.add_argument("--published-soap", metavar="FILE", required=True,
                        help="soap.py of github.com/nikhilvyas/SOAP")
    parser.add_argument("--n-layer", type=int, default=6, help="model layers")
    parser.add_argument("--n-head", type=int, default=6, help="attention heads")
    parser.add_argument("--n-embd", type=int, default=384, help="model width")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=53, help="optimizer steps (the first only builds the bases)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="parameters and state")
    parser.add_argument("--turn-null-space", action="store_true",
                        help="also run the published SOAP with its first bases' null spaces turned")
    args = parser.parse_args(argv)
    if not Path(args.published_soap).is_file():
        parser.error(f"--published-soap {args.published_soap}: no such file")
    dtype = getattr(torch, args.dtype)
    model_cfg = train_gpt.GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    cfg = SOAPConfig()
    published = load_published_soap(Path(args.published_soap))
    runs = {"ours": None, "published": published}
    if args.turn_null_space:
        runs["published, null space turned"] = turned_null_space(published)
    start, end = None, {}
    for name, soap in runs.items():
        torch.manual_seed(0)
        model = train_gpt.GPT(model_cfg).to(dtype)
        if start is None:
            start = {n: p.detach().clone() for n, p in model.named_parameters()}
        if soap is None:
            optimizer = OPTIMIZERS["soap"].build(model, cfg)
        else:
            optimizer = soap(model.parameters(), **published_soap_settings(cfg))
        train(model, optimizer, args)
        end[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = end["published"]
    moved = torch.cat([(reference[n] - start[n]).flatten() for n in start]).norm().item()
    print(f"L={args.n_layer} H={args.n_head} C={args.n_embd} | {args.steps} steps of {args.batch} x {args.seq_len} "
          f"tokens | {args.dtype} | the published run moved {moved:.4g} (L2 over all parameters)")
    for name, params in end.items():
        if name == "published":
            continue
        diffs = {n: (params[n] - reference[n]).abs().max().item() for n in start}
        worst = max(diffs, key=diffs.get)
        distance = torch.cat([(params[n] - reference[n]).flatten() for n in start]).norm().item()
        print(f"{name} vs published: max |difference| {diffs[worst]:.4g} ({worst}), distance per distance moved "
              f"{distance / moved:.3g}")
        top = sorted(diffs, key=diffs.get, reverse=True)[:5]
        print("  largest: " + ", ".join(f"{n} {diffs[n]:.3g}" for n in top))


if __name__ == "__main__":
    main()
