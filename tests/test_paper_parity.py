"""The paper presets reproduce the published runs (docs/optimizers.md#paper-parity).

Config level: --preset gpt2-124m with each of the paper's optimizers builds the published run (batch, schedule,
token budget, Table 9 hyperparameters, ECD's per-tensor projection, decay of every parameter) and says what differs.
Trajectory level: on a tiny GPT in float64, the optimizers those presets build follow float64 NumPy transcriptions of
the published ECD and SOAP to ~1e-12 of the distance moved, while the other named options (ECD's global projection,
decay of matrices only) leave them by a measurable fraction of it.
"""
from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
import torch

import config
import train_gpt
from optim import OPTIMIZERS
from run.checkpoint import load_checkpoint
from run.log import read_log
from run.process import batch_layout
from tests.helpers import reference_soap, tiny_args, tiny_gpt, write_v1_checkpoint

ECD_STEPS, SOAP_STEPS = 20, 25
VOCAB, SEQ, BATCH = 64, 32, 4
# The first eigenbases come from one gradient, whose Gram on the longer side of a non-square matrix has a null space
# of many dimensions: any basis of it is an eigenbasis, and Adam's first steps in two different ones differ by about
# the learning rate. Rotating only the sides of length n_embd (whose Grams have at most a one-dimensional null
# space, where the basis is fixed up to a sign that cancels) makes the comparison well posed.
SOAP_MAX_PRECOND_DIM = 32
# Even then the spectra span seven decades, and Adam's m/(√v + ε) divides rounding-level differences between two
# faithful implementations by ε where v is small: at the paper's ε = 1e-8 they part by ~1e-6 of the distance
# moved, at ε = 1e-4 by ~1e-10 (the drift scales as 1/ε, as rounding noise does).
SOAP_EPS = {"paper": 1e-8, "conditioned": 1e-4}
TABLE_9 = {
    "ecd": {"lr": 1.0, "ecd_eta": 100.0, "ecd_f0": 2.0, "weight_decay": 0.0, "ecd_nu": 0.0,
            "ecd_projection": "per_tensor", "decay_groups": "all"},
    "sgdm": {"lr": 0.03, "momentum": 0.95, "nesterov": True, "weight_decay": 0.0, "decay_groups": "all"},
    "adamw": {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "decay_groups": "all"},
    "soap": {"lr": 3e-4, "beta1": 0.95, "beta2": 0.95, "soap_precondition_frequency": 10,
             "soap_max_precond_dim": 10000, "weight_decay": 0.01, "decay_groups": "all"},
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny float64 models: one intra-op thread is fastest, and does not spin against other jobs on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------------------
# Config level


@pytest.mark.parametrize("preset", ["gpt2-124m", "gpt2-124m-gelu"])
@pytest.mark.parametrize("optimizer", sorted(TABLE_9))
def test_paper_presets_build_the_published_run(preset, optimizer):
    cfg = train_gpt.parse_config(["--preset", preset, "--optimizer", optimizer])
    assert {k: getattr(cfg.optim, k) for k in TABLE_9[optimizer]} == TABLE_9[optimizer]
    hp = cfg.train
    assert (hp.seq_len, hp.batch_tokens, hp.lr_schedule, hp.warmup_steps, hp.grad_clip) == (512, 4096, "constant",
                                                                                            0, 0.0)
    assert hp.steps * hp.batch_tokens == pytest.approx(500e6, rel=1e-4)  # 500M tokens
    for world in (1, 2, 4, 8):
        assert batch_layout(hp, world)[1] == 1  # no gradient accumulation
    model = cfg.model
    assert (model.n_layer, model.n_head, model.n_embd, model.block_size, model.vocab_size) == (12, 12, 768, 512, 50304)
    assert model.activation == ("gelu" if preset.endswith("gelu") else "prelu")
    report = config.preset_report(cfg)
    assert report["name"] == preset
    assert report["differs"] == [config.PRECISION_NOTES["bf16"], config.VALIDATION_PROTOCOL_NOTE]


def test_the_defaults_are_the_paper_run():
    for optimizer in TABLE_9:
        plain = train_gpt.parse_config(["--optimizer", optimizer])
        paper = train_gpt.parse_config(["--preset", "gpt2-124m", "--optimizer", optimizer])
        assert plain.to_dict() == paper.to_dict()
        assert config.preset_report(plain)["differs"] == [config.PRECISION_NOTES["bf16"],
                                                              config.VALIDATION_PROTOCOL_NOTE]


def test_report_names_every_departure_from_the_published_run():
    cfg = train_gpt.parse_config(["--preset", "gpt2-124m", "--optimizer", "ecd", "--ecd-projection", "global",
                                  "--decay-groups", "matrices", "--micro-batch", "4", "--lr-schedule", "cosine",
                                  "--ecd-nu", "0.1", "--val-every", "50", "--dtype", "fp32"])
    differs = config.preset_report(cfg)["differs"]
    assert differs[:-2] == ["--micro-batch 4 (gpt2-124m: 8)", "--lr-schedule cosine (gpt2-124m: constant)",
                            "--decay-groups matrices (gpt2-124m: all)", "--ecd-nu 0.1 (gpt2-124m: 0.0)",
                            "--ecd-projection global (gpt2-124m: per_tensor)"]
    assert differs[-2:] == [config.PRECISION_NOTES["fp32"], config.VALIDATION_PROTOCOL_NOTE]
    muon = config.preset_report(train_gpt.parse_config(["--preset", "gpt2-124m", "--optimizer", "muon"]))
    assert "not one of the paper's optimizers" in muon["differs"][0]
    assert config.preset_report(train_gpt.parse_config(["--preset", "smoke"]))["differs"] == []


def test_report_says_where_the_paper_and_its_published_code_disagree():
    adamw = config.preset_report(train_gpt.parse_config(["--preset", "gpt2-124m", "--optimizer", "adamw"]))
    (note,) = adamw["sources"]
    for setting in ("Table 9", "(0.9, 0.999)", "(0.9, 0.95)", "weight decay 0.01", "scripts/train.py"):
        assert setting in note
    assert f"\n  {note}" in config.preset_lines(adamw)
    (note,) = config.preset_report(train_gpt.parse_config(["--preset", "gpt2-124m", "--optimizer", "sgdm"]))["sources"]
    assert "Table 1" in note and "N(0, 0.1^2)" in note and "PReLU script starts at rest" in note
    for optimizer in ("ecd", "soap"):  # Table 9 and the published code agree
        assert config.preset_report(train_gpt.parse_config(["--optimizer", optimizer]))["sources"] == []


# ----------------------------------------------------------------------------------------------------------------
# Trajectory level: a tiny GPT in float64


def tiny_double() -> train_gpt.GPT:
    return tiny_gpt(vocab_size=VOCAB, block_size=SEQ).double()


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    seq = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def loss_of(model: train_gpt.GPT, step: int) -> torch.Tensor:
    """Cross-entropy in float64 (the model's own loss is computed in float32) with the mean biases."""
    x, y = tokens(step)
    logits = model(x, all_logits=True)[0]
    return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), y.reshape(-1))


def paper_optimizer(model: train_gpt.GPT, optimizer: str, *flags: str) -> torch.optim.Optimizer:
    """The optimizer that --preset gpt2-124m --optimizer NAME (plus flags) builds for `model`."""
    cfg = train_gpt.parse_config(["--preset", "gpt2-124m", "--optimizer", optimizer, *flags])
    opt = OPTIMIZERS[optimizer].build(model, cfg.optim)
    return opt


def train(model: train_gpt.GPT, opt: torch.optim.Optimizer, steps: int, needs_loss: bool) -> dict[str, np.ndarray]:
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        opt.step(loss.detach()) if needs_loss else opt.step()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def gradient_oracle():
    """(names, initial arrays, loss_and_grad(arrays, step)) on a fresh tiny GPT: the oracles' only use of torch."""
    model = tiny_double()
    named = list(model.named_parameters())

    def loss_and_grad(arrays: list[np.ndarray], step: int) -> tuple[float, list[np.ndarray]]:
        with torch.no_grad():
            for (_, p), a in zip(named, arrays):
                p.copy_(torch.from_numpy(a))
        model.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        return loss.item(), [p.grad.numpy().copy() for _, p in named]

    return [n for n, _ in named], [p.detach().numpy().copy() for _, p in named], loss_and_grad


def published_ecd(theta: list[np.ndarray], loss_and_grad, steps: int, lr: float, eta: float, F0: float,
                  wd: float) -> list[np.ndarray]:
    """ECD q=1 as published (docs/optimizers.md#ecd), ν = 0: Π·g̃ per parameter tensor, F̃ = F + ½λ‖θ‖² over
    every parameter, energy conservation on, eps1 = 1e-10, eps2 = 1e-40. Float64 NumPy, one array per tensor."""
    D = sum(t.size for t in theta)
    h = lr / math.sqrt(eta)
    kappa = 0.5 * h * eta * D / (D - 1)
    pi = None
    for step in range(steps):
        F, g = loss_and_grad(theta, step)
        Ft = F + 0.5 * wd * sum(np.sum(t * t) for t in theta)
        gt = [gi + wd * t for gi, t in zip(g, theta)]
        if pi is None:
            norm = math.sqrt(sum(np.sum(gi * gi) for gi in g))
            pi = [-gi / norm for gi in g]
        if Ft - F0 <= 1e-40:
            continue
        norm2 = sum(np.sum(p * p) for p in pi)
        if abs(norm2 - 1) >= 1e-10:
            pi = [p / math.sqrt(norm2) for p in pi]
        pi = [p - kappa / (Ft - F0) * (gi - p * np.sum(p * gi)) for p, gi in zip(pi, gt)]
        theta = [t + h * p for t, p in zip(theta, pi)]
    return theta


def published_soap(theta: list[np.ndarray], loss_and_grad, steps: int, wd: float, eps: float) -> list[np.ndarray]:
    """SOAP as published (tests.helpers.reference_soap, the transcription tests/test_optim_soap.py checks) with the
    Table 9 hyperparameters but SOAP_MAX_PRECOND_DIM and `eps`, decoupled decay `wd` on every parameter."""
    cfg = TABLE_9["soap"]
    return reference_soap([t.copy() for t in theta], lambda arrays, step: loss_and_grad(arrays, step)[1], steps,
                          cfg["lr"], (cfg["beta1"], cfg["beta2"]), eps, [wd] * len(theta),
                          cfg["soap_precondition_frequency"], SOAP_MAX_PRECOND_DIM, False, False, None)


def drift(got: dict[str, np.ndarray], names: list[str], start: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """‖got − ref‖ / ‖ref − start‖ over all parameters: the distance from the oracle per distance moved."""
    moved = math.sqrt(sum(np.sum((r - s) ** 2) for r, s in zip(ref, start)))
    assert moved > 1e-3, moved
    return math.sqrt(sum(np.sum((got[n] - r) ** 2) for n, r in zip(names, ref))) / moved


@functools.cache
def ecd_oracle(weight_decay: float):
    """The published ECD at the paper's hyperparameters with λ = weight_decay: 0 (Table 9) or 0.1 (also tried)."""
    names, start, loss_and_grad = gradient_oracle()
    cfg = TABLE_9["ecd"]
    return names, start, published_ecd(start, loss_and_grad, ECD_STEPS, cfg["lr"], cfg["ecd_eta"], cfg["ecd_f0"],
                                       weight_decay)


@pytest.fixture(scope="module", params=sorted(SOAP_EPS))
def soap_oracle(request):
    names, start, loss_and_grad = gradient_oracle()
    eps = SOAP_EPS[request.param]
    return request.param, (names, start, published_soap(start, loss_and_grad, SOAP_STEPS, 0.01, eps))


def ecd_run(weight_decay: float, *flags: str) -> dict[str, np.ndarray]:
    model = tiny_double()
    opt = paper_optimizer(model, "ecd", "--weight-decay", str(weight_decay), *flags)
    return train(model, opt, ECD_STEPS, needs_loss=True)


def soap_run(eps_name: str, *flags: str) -> dict[str, np.ndarray]:
    model = tiny_double()
    flags = ("--soap-max-precond-dim", str(SOAP_MAX_PRECOND_DIM), "--eps", str(SOAP_EPS[eps_name]), *flags)
    return train(model, paper_optimizer(model, "soap", *flags), SOAP_STEPS, needs_loss=False)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_paper_ecd_follows_the_published_ecd(weight_decay):
    assert drift(ecd_run(weight_decay), *ecd_oracle(weight_decay)) < 1e-12


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_ecd_global_projection_leaves_the_published_trajectory(weight_decay):
    assert drift(ecd_run(weight_decay, "--ecd-projection", "global"), *ecd_oracle(weight_decay)) > 0.05


def test_ecd_decaying_matrices_only_leaves_the_published_trajectory():
    assert drift(ecd_run(0.1, "--decay-groups", "matrices"), *ecd_oracle(0.1)) > 0.05


def test_paper_soap_follows_the_published_soap(soap_oracle):
    eps_name, oracle = soap_oracle
    assert drift(soap_run(eps_name), *oracle) < {"paper": 1e-5, "conditioned": 1e-9}[eps_name]


def test_soap_decaying_matrices_only_leaves_the_published_trajectory(soap_oracle):
    eps_name, oracle = soap_oracle
    assert drift(soap_run(eps_name, "--decay-groups", "matrices"), *oracle) > 1e-3


def test_paper_sgdm_starts_from_a_seeded_random_velocity():
    """Table 1's SGDM runs start with a nonzero velocity: the published GELU script's buffers ~ N(0, 0.1²)."""
    model = tiny_double()
    opt = paper_optimizer(model, "sgdm")
    params = [p for group in opt.param_groups for p in group["params"]]
    velocity = [opt.state[p]["momentum_buffer"].clone() for p in params]
    flat = torch.cat([v.flatten() for v in velocity])
    assert flat.numel() > 10_000 and abs(flat.std().item() - 0.1) < 0.005 and abs(flat.mean().item()) < 0.005
    again = paper_optimizer(tiny_double(), "sgdm")
    assert all(torch.equal(a.state[p]["momentum_buffer"], v) for a in [again] for p, v in
               zip([p for g in again.param_groups for p in g["params"]], velocity))
    other = paper_optimizer(tiny_double(), "sgdm", "--optim-seed", "1")
    assert not torch.equal(other.state[next(iter(other.state))]["momentum_buffer"], velocity[0])
    # torch's Nesterov SGD from that velocity: buf = μv + g, θ ← θ − lr (g + μ buf)
    before = [p.detach().clone() for p in params]
    opt.zero_grad()
    loss_of(model, 0).backward()
    grads = [p.grad.clone() for p in params]
    opt.step()
    for p, p0, g, v in zip(params, before, grads, velocity):
        torch.testing.assert_close(p.detach(), p0 - 0.03 * (g + 0.95 * (0.95 * v + g)), rtol=0, atol=1e-12)
    at_rest = paper_optimizer(tiny_double(), "sgdm", "--initial-velocity-std", "0")
    assert not at_rest.state  # torch's SGD: the buffer starts at the first gradient


def test_each_seed_draws_its_own_initial_velocity_and_records_it():
    """The published script draws SGDM's velocity after seeding, so Table 1's two SGDM seeds start from different
    velocities; --optim-seed (recorded in config.json) fixes one draw whatever the seed."""
    def first_buffer(*flags: str) -> torch.Tensor:
        opt = paper_optimizer(tiny_double(), "sgdm", *flags)
        return next(iter(opt.state.values()))["momentum_buffer"]

    assert train_gpt.parse_config(["--preset", "gpt2-124m", "--optimizer", "sgdm", "--seed", "123"]).optim.optim_seed \
        == 123
    assert not torch.equal(first_buffer("--seed", "42"), first_buffer("--seed", "123"))
    assert torch.equal(first_buffer("--seed", "42"), first_buffer("--seed", "42"))
    assert torch.equal(first_buffer("--seed", "42", "--optim-seed", "7"), first_buffer("--seed", "123", "--optim-seed",
                                                                                      "7"))


# ----------------------------------------------------------------------------------------------------------------
# The run records the published validation estimate and what differs


def test_run_logs_the_single_batch_estimate_and_the_preset_report(corpus, tmp_path, capsys):
    from data.loader import validation_batches

    summary = train_gpt.main(tiny_args(corpus, tmp_path, "parity", steps=8, **{"val-every": 4}))
    run = tmp_path / "parity"
    records = [r for r in read_log(run) if "val_loss_batch" in r]
    estimates = {r["step"]: r["val_loss_batch"] for r in records if r["val_loss_batch"] is not None}
    assert set(estimates) == {4, 8}  # the multiples of --val-every; not step 0
    model = train_gpt.model_from_checkpoint(load_checkpoint(run / "checkpoints" / "latest.pt"))
    config = json.loads((run / "config.json").read_text())
    hp = config["train"]
    # at the 2nd multiple of --val-every: the 2nd batch of --batch-tokens validation tokens
    rows = hp["batch_tokens"] // hp["seq_len"]
    (_, (x, y, _)) = validation_batches(hp["val_files"], rows, hp["seq_len"], 2 * hp["batch_tokens"])
    with torch.no_grad():
        expected = model(x, y)[1].item()
    assert estimates[8] == pytest.approx(expected, rel=1e-6)
    assert summary["best_val_loss_batch"] == min(estimates.values())
    assert config["preset"]["name"] is None and config["preset"]["compared_with"] == "gpt2-124m"
    assert "--n-layer 2 (gpt2-124m: 12)" in config["preset"]["differs"]
    log = (run / "log.txt").read_text()
    assert "preset none (compared with gpt2-124m): reproduces" in log and "differs: --n-layer 2 (gpt2-124m: 12)" in log
    assert "single-batch val loss" in log

    # --val-biases last-sample: the published trainer's protocol, the estimate at the last training step's draw; the
    # training and the fixed-budget validation (at the means) are the same run's
    train_gpt.main(tiny_args(corpus, tmp_path, "last", steps=8, **{"val-every": 4, "val-biases": "last-sample"}))
    last = {r["step"]: r for r in read_log(tmp_path / "last") if r.get("val_loss_batch") is not None}
    model = train_gpt.model_from_checkpoint(load_checkpoint(tmp_path / "last" / "checkpoints" / "latest.pt"))
    sampler = train_gpt.BiasSampler(model.config, hp["seed"])
    with torch.no_grad():
        assert last[8]["val_loss_batch"] == pytest.approx(model(x, y, sampler.sample(7))[1].item(), rel=1e-6)
    assert last[8]["val_loss_batch"] != estimates[8]  # the means: another number
    assert [last[s]["val_loss"] for s in (4, 8)] == [r["val_loss"] for r in records if r["step"] in (4, 8)]

    # the decay groups are the optimizer's parameter groups: fixed on resume; a checkpoint written before
    # --decay-groups existed resumes with the groups its two switches meant
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--resume", str(run), "--decay-groups", "matrices"])
    assert "--decay-groups cannot change when resuming" in capsys.readouterr().err
    old = tmp_path / "old" / "checkpoints" / "latest.pt"
    old.parent.mkdir(parents=True)
    write_v1_checkpoint(run / "checkpoints" / "latest.pt", old)
    ckpt = torch.load(old, weights_only=False)
    del ckpt["config"]["optim"]["decay_groups"], ckpt["checksum"]  # a v1 file from before --decay-groups
    ckpt["config"]["optim"].update(decay_embeddings=True, decay_norms_and_biases=False)
    torch.save(ckpt, old)
    assert train_gpt.parse_config(["--resume", str(old)]).optim.decay_groups == "matrices+embeddings"
