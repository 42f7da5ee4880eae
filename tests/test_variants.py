"""Model variants (docs/variants.md): symmetric initialisation, the masked-LM objective (masking, loss, attention in
both directions, exact resume, split invariance) and relational attention (O(C) equivariance, training, optimizers,
refused combinations). Tiny models on the CPU."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt
import variants
from data.loader import DistributedTokenLoader, validation_batches
from eval import alignment
from kernels.attention_paths import attention_reference
from optim import OPTIMIZERS
from run.checkpoint import load_checkpoint
from run.log import read_log
from tests import helpers
from tests.helpers import tiny_gpt

VOCAB, MASK = 136, 128  # the synthetic corpus uses ids 1..127, so 128 is free for [MASK]
TINY = dict(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=2, n_embd=32, mask_token=MASK)


def tiny_model(seed: int = 0, **overrides) -> train_gpt.GPT:
    return tiny_gpt(seed, **{**TINY, **overrides})


def symmetry_score(m: torch.Tensor) -> float:
    """s = (‖M_s‖² − ‖M_n‖²)/‖M‖² with M_s, M_n the symmetric and antisymmetric parts (docs/structure.md)."""
    sym, anti = (m + m.T) / 2, (m - m.T) / 2
    return ((sym.square().sum() - anti.square().sum()) / m.square().sum()).item()


def qk_products(model: train_gpt.GPT) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Per layer: (Σ_h M_QK^h = W_Qᵀ W_K, [M_QK^h = A_Q A_Kᵀ per head]) in float64 (docs/model.md#conventions)."""
    cfg, out = model.config, []
    C, d = cfg.n_embd, cfg.head_dim
    for block in model.transformer.h:
        w = block.attn.c_attn.weight.detach().double()
        w_q, w_k = w[:C], w[C:2 * C]
        heads = [w_q[h * d:(h + 1) * d].T @ w_k[h * d:(h + 1) * d] for h in range(cfg.n_head)]
        out.append((w_q.T @ w_k, heads))
    return out


# ----- symmetric initialisation -----

def test_symmetric_init_gives_symmetry_score_one_per_head_and_layer():
    for layer, heads in qk_products(tiny_model(init="symmetric")):
        assert symmetry_score(layer) == pytest.approx(1.0, abs=1e-12)
        assert all(symmetry_score(h) == pytest.approx(1.0, abs=1e-12) for h in heads)
    for layer, heads in qk_products(tiny_model(init="normal")):  # the default is far from symmetric
        assert abs(symmetry_score(layer)) < 0.5
        assert all(abs(symmetry_score(h)) < 0.5 for h in heads)


def test_symmetric_init_only_copies_the_queries_into_the_keys():
    normal, symmetric = tiny_model(init="normal"), tiny_model(init="symmetric")
    C = normal.config.n_embd
    for (name, a), b in zip(normal.state_dict().items(), symmetric.state_dict().values()):
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            assert torch.equal(a[:C], b[:C]) and torch.equal(a[2 * C:], b[2 * C:])
            assert torch.equal(b[C:2 * C], b[:C])
            assert name.endswith("bias") or not torch.equal(a[C:2 * C], b[C:2 * C])  # biases start at zero
        else:
            assert torch.equal(a, b), name


# ----- masked-LM objective -----

def test_masking_rate_and_targets():
    cfg = train_gpt.GPTConfig(**TINY, objective="mlm")
    masker = variants.MaskedLM(cfg)
    x = torch.randint(1, MASK, (16, 100))
    inputs, targets = masker.batch(x, x, first_row=0, step_key=(1337, 5))
    masked = targets != -1
    assert (masked.sum(dim=1) == 15).all()  # round(0.15 · 100) positions in every row
    assert torch.equal(targets[masked], x[masked]) and (inputs[masked] == MASK).all()
    assert torch.equal(inputs[~masked], x[~masked])
    rows_differ = sum(not torch.equal(masked[i], masked[0]) for i in range(1, 16))
    assert rows_differ == 15  # each row its own positions
    counts = masked.sum(dim=0).float()  # every position is masked about equally often
    many = torch.from_numpy(masker.positions(0, 4000, 100, step_key=(1337, 5))).float().mean(dim=0)
    assert many.mean().item() == pytest.approx(0.15) and (many - 0.15).abs().max() < 0.03, counts
    assert masker.masked_count(3) == 1  # never an unscored sequence


def test_masks_depend_on_seed_step_and_row_only():
    masker = variants.MaskedLM(train_gpt.GPTConfig(**TINY, objective="mlm"))
    whole = masker.positions(0, 8, 64, step_key=(7, 3))
    split = np.concatenate([masker.positions(0, 3, 64, step_key=(7, 3)), masker.positions(3, 5, 64, step_key=(7, 3))])
    assert np.array_equal(whole, split)  # a row's mask does not depend on the micro-batch it is in
    assert not np.array_equal(whole, masker.positions(0, 8, 64, step_key=(7, 4)))  # another step
    assert not np.array_equal(whole, masker.positions(0, 8, 64, step_key=(8, 3)))  # another seed
    assert np.array_equal(masker.positions(0, 8, 64), masker.positions(0, 8, 64))  # validation: fixed
    assert not np.array_equal(masker.positions(0, 8, 64), whole)


def test_mlm_loss_scores_only_the_masked_positions():
    model = tiny_model(objective="mlm")
    x = torch.randint(1, MASK, (4, 32))
    inputs, targets = variants.MaskedLM(model.config).batch(x, x, 0, (0, 0))
    logits, loss = model(inputs, targets)
    masked = targets != -1
    assert loss.item() == pytest.approx(F.cross_entropy(logits[masked], x[masked]).item(), rel=1e-6)
    logits.retain_grad()
    loss.backward()
    assert (logits.grad[~masked] == 0).all() and (logits.grad[masked] != 0).any()


@pytest.mark.parametrize("variant", [{}, {"attention": "relational", "bias_mode": "none"}])
def test_mlm_attends_to_later_tokens_and_clm_does_not(variant):
    x = torch.randint(1, MASK, (2, 32))
    later = x.clone()
    later[:, -1] = (later[:, -1] + 1) % MASK
    for objective, sees_the_future in (("clm", False), ("mlm", True)):
        model = tiny_model(objective=objective, **variant).eval()
        with torch.no_grad():
            first = model(x, all_logits=True)[0][:, :-1]
            changed = model(later, all_logits=True)[0][:, :-1]
        assert (not torch.allclose(first, changed, atol=1e-7)) == sees_the_future, objective


def test_bv_rewrite_is_exact_without_the_causal_mask():
    """Adding b_V to the output equals adding it to every value: each softmax row sums to one, masked or not."""
    q, k, v = torch.randn(3, 2, 2, 9, 16, dtype=torch.float64).unbind(0)
    b_v = torch.randn(16, dtype=torch.float64)
    for causal in (False, True):
        rewritten = attention_reference(q, k, v, b_v=b_v, causal=causal)
        direct = F.scaled_dot_product_attention(q, k, v + b_v, is_causal=causal)
        torch.testing.assert_close(rewritten, direct, rtol=1e-12, atol=1e-12)


def tiny_args(corpus: Path, run_dir: Path, name: str, **overrides) -> list[str]:
    """tests.helpers.tiny_args on the shared corpus with room for [MASK] in the vocabulary."""
    return helpers.tiny_args(corpus, run_dir, name, **{"vocab-size": VOCAB, "mask-token": MASK, **overrides})


def logged(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_log(run_dir) if r.get(key) is not None and "summary" not in r}


def test_mlm_resume_reproduces_the_trajectory(corpus, tmp_path):
    mlm = {"objective": "mlm", "checkpoint-every": 3, "keep-checkpoints": -1}
    train_gpt.main(tiny_args(corpus, tmp_path, "straight", **mlm))
    straight = logged(tmp_path / "straight", "train_loss")
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    checkpoint = tmp_path / "straight" / "checkpoints" / "step_000003.pt"
    (resumed_dir / "checkpoints" / "latest.pt").write_bytes(checkpoint.read_bytes())
    train_gpt.main(["--resume", str(resumed_dir)])
    resumed = logged(resumed_dir, "train_loss")
    assert sorted(resumed) == [4, 5, 6, 7, 8]
    assert all(resumed[step] == straight[step] for step in resumed), (resumed, straight)
    vals = logged(tmp_path / "straight", "val_loss")
    assert vals[4] < vals[0] and vals[0] > math.log(VOCAB) - 0.5  # it learns, from about uniform


def test_mlm_losses_do_not_depend_on_the_micro_batch_split(corpus, tmp_path):
    """Masks are keyed by the row's index in the step's batch, and every row has as many masked positions, so 4
    micro-steps of 2 rows and 1 of 8 give the same training and validation losses."""
    common = {"objective": "mlm", "steps": 2, "val-every": 0}
    train_gpt.main(tiny_args(corpus, tmp_path, "two", **common, **{"micro-batch": 2}))
    train_gpt.main(tiny_args(corpus, tmp_path, "eight", **common, **{"micro-batch": 8}))
    small, large = logged(tmp_path / "two", "train_loss"), logged(tmp_path / "eight", "train_loss")
    assert sorted(small) == sorted(large) == [1, 2]
    for step in small:
        assert small[step] == pytest.approx(large[step], rel=1e-5)
    val_small, val_large = logged(tmp_path / "two", "val_loss")[2], logged(tmp_path / "eight", "val_loss")[2]
    assert val_small == pytest.approx(val_large, rel=1e-5)


def test_training_masks_follow_the_rows_whatever_the_ranks(corpus):
    """The trainer keys a micro-batch's masks by its first row in the step's batch, chunk x micro_batch: two ranks
    with micro-batches of 2 mask every row of a step as one process with one micro-batch of 8 does."""
    masker, files = variants.MaskedLM(train_gpt.GPTConfig(**TINY, objective="mlm")), corpus / "syn_train_*.bin"

    def masked_rows(rank: int, world: int, micro_batch: int) -> dict[tuple[int, int], torch.Tensor]:
        rows = {}
        with DistributedTokenLoader(files, micro_batch, 32, rank=rank, world_size=world,
                                    grad_accum_steps=8 // (world * micro_batch), prefetch=0) as loader:
            for step in range(2):
                for _ in range(8 // (world * micro_batch)):
                    x, _, chunk = loader.next_batch()
                    inputs, _ = masker.batch(x, x, chunk * micro_batch, (1337, step))
                    rows.update({(step, chunk * micro_batch + i): row for i, row in enumerate(inputs)})
        return rows

    one = masked_rows(0, 1, 8)
    two = {**masked_rows(0, 2, 2), **masked_rows(1, 2, 2)}
    assert sorted(one) == sorted(two) and len(one) == 16
    assert all(torch.equal(one[key], two[key]) for key in one)


def test_mlm_validation_loss_is_the_same_on_every_call(corpus):
    """Fixed validation masks: the same loss on every call and whatever the micro-batch."""
    val = str(corpus / "syn_val_*.bin")

    def loss(model: train_gpt.GPT, micro_batch: int, rank: int = 0, world: int = 1) -> float:
        return train_gpt.evaluate(model, val, 1024, 32, micro_batch, rank=rank, world=world)

    mlm = tiny_model(objective="mlm")
    losses = [loss(mlm, micro_batch) for micro_batch in (4, 4, 8)]
    assert losses[0] == losses[1] and losses[2] == pytest.approx(losses[0], rel=1e-6)
    two_ranks = [loss(mlm, 4, rank, 2) for rank in (0, 1)]  # each rank's share (no process group: no averaging)
    assert sum(two_ranks) / 2 == pytest.approx(losses[0], rel=1e-6) and two_ranks[0] != two_ranks[1]
    masker, by_hand = variants.MaskedLM(mlm.config), []
    for x, _, first in validation_batches(val, 8, 32, 1024):
        inputs, targets = masker.batch(x, x, first_row=first)  # the validation stream's rows first .. first + 7
        with torch.no_grad():
            by_hand.append(mlm(inputs, targets)[1].item())
    assert losses[2] == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-6)


def test_mlm_single_batch_estimate_is_the_masked_loss(corpus, tmp_path):
    """--val-batch-estimate under --objective mlm scores the validation stream's masked positions, as val_loss does
    (it once reported the unmasked next-token loss)."""
    train_gpt.main(tiny_args(corpus, tmp_path, "estimate", objective="mlm", steps=8, **{"val-every": 4}))
    run = tmp_path / "estimate"
    estimates = logged(run, "val_loss_batch")
    assert sorted(estimates) == [4, 8]
    model = train_gpt.model_from_checkpoint(load_checkpoint(run / "checkpoints" / "latest.pt"))
    # at the 2nd multiple of --val-every: the 2nd batch of --batch-tokens (8 rows of 32) validation tokens
    (_, (x, y, first)) = validation_batches(str(corpus / "syn_val_*.bin"), 8, 32, 2 * 256)
    assert first == 8
    inputs, targets = variants.MaskedLM(model.config).batch(x, x, first_row=first)
    with torch.no_grad():
        masked, unmasked = model(inputs, targets)[1].item(), model(x, y)[1].item()
    assert estimates[8] == pytest.approx(masked, rel=1e-6)
    assert abs(masked - unmasked) > 0.05  # the two losses are far apart: the test tells them apart


# ----- relational attention -----

def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


@pytest.mark.parametrize("objective", ["clm", "mlm"])
def test_relational_attention_output_rotates_with_its_input(objective):
    layer = tiny_model(attention="relational", bias_mode="none", objective=objective).transformer.h[0].attn.double()
    with torch.no_grad():
        layer.mix.copy_(torch.tensor([0.7, -1.3], dtype=torch.float64))  # heads weighted differently
        x = torch.randn(3, 17, 32, dtype=torch.float64)
        y = layer(x)
        for seed in range(3):
            rotation = random_orthogonal(32, seed)
            torch.testing.assert_close(layer(x @ rotation), y @ rotation, rtol=1e-10, atol=1e-12)
        shear = torch.eye(32, dtype=torch.float64) + 0.3 * torch.randn(32, 32, dtype=torch.float64)
        assert not torch.allclose(layer(x @ shear), y @ shear, atol=1e-3)  # only orthogonal maps commute with it
    assert y.abs().max() > 0


def test_relational_model_trains(corpus, tmp_path):
    summary = train_gpt.main(tiny_args(corpus, tmp_path, "relational", attention="relational", **{
        "bias-mode": "none", "steps": 16, "val-every": 8}))
    vals = logged(tmp_path / "relational", "val_loss")
    assert vals[16] < vals[0] - 0.5, vals
    assert summary["step"] == 16
    model = train_gpt.model_from_checkpoint(tmp_path / "relational" / "checkpoints" / "latest.pt")
    assert isinstance(model.transformer.h[0].attn, variants.RelationalAttention)
    with pytest.raises(SystemExit, match="b_Q alignment needs the keys of standard attention"):
        alignment.main(["--run", str(tmp_path / "relational"), "--modes", "raw"])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_steps_a_relational_model(name):
    model = tiny_model(attention="relational", bias_mode="none")
    opt = OPTIMIZERS[name].build(model, OPTIMIZERS[name].config())
    owned = [p for group in opt.param_groups for p in group["params"]]
    assert sorted(map(id, owned)) == sorted(id(p) for p in model.parameters())
    x = torch.randint(1, MASK, (2, 32))
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        loss = model(x[:, :-1], x[:, 1:])[1]
        loss.backward()
        opt.step(loss.detach()) if OPTIMIZERS[name].needs_loss else opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    mix = model.transformer.h[0].attn.mix
    assert not torch.equal(mix, before[[id(p) for p in model.parameters()].index(id(mix))])


@pytest.mark.parametrize("flags, error", [
    (["--attention", "relational"], "add --bias-mode none"),
    (["--attention", "relational", "--bias-mode", "none", "--init", "symmetric"], "use --init normal"),
    (["--attention", "relational", "--bias-mode", "none", "--optimizer", "ecd", "--dynamics-every", "5"],
     "--attention relational does not have"),
    (["--attention", "relational", "--bias-mode", "none", "--gauge", "dress"], "--attention relational does not have"),
    (["--attention", "relational", "--bias-mode", "none", "--micro-batch", "64", "--seq-len", "512"],
     "lower --micro-batch"),
    (["--objective", "mlm", "--vocab-size", "50257"], "--mask-token 50257 is not an id of the vocabulary"),
    (["--mask-prob", "0"], "--mask-prob must be (0, 1], got 0.0"),
])
def test_combinations_that_cannot_work_are_refused(flags, error, capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--device", "cpu", *flags])
    assert error in capsys.readouterr().err


def test_small_relational_configurations_are_accepted():
    cfg = train_gpt.parse_config(["--preset", "smoke", "--attention", "relational", "--bias-mode", "none",
                                  "--objective", "mlm"])
    assert cfg.model.attention == "relational" and cfg.model.objective == "mlm"
