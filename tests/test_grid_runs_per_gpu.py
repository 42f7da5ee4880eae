"""python -m grid --runs-per-gpu N (docs/grid.md#several-runs-per-gpu) with a fake list of GPUs: N slots per GPU in
the plan, spread over the GPUs first; a memory estimate that refuses an N that does not fit, with the numbers; the
slots in grid.jsonl and `grid status`; the estimate's optimizer state equal to what the optimizers hold after a
step, and its activations what the trainer's forward pass keeps on real CPU tensors."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import train_gpt
from grid import memory
from grid.__main__ import main
from grid.execute import Journal
from optim import OPTIMIZERS, optimizer_state_bytes
from tests.helpers import VOCAB, tiny_gpt


def tiny(corpus) -> list[str]:
    """Shared flags of a 1-layer model on the synthetic corpus, device auto (a CUDA run when the grid has GPUs)."""
    return ["--train-files", str(corpus / "syn_train_*.bin"), "--val-files", str(corpus / "syn_val_*.bin"),
            "--vocab-size", str(VOCAB), "--block-size", "32", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
            "--seq-len", "16", "--batch-tokens", "32", "--micro-batch", "2", "--val-tokens", "32", "--no-compile",
            "--log-every", "1", "--steps", "2"]


def test_runs_share_each_gpu_in_the_plan_spread_over_the_gpus_first(tmp_path, capsys):
    assert main(["--name", "p", "--run-dir", str(tmp_path), "--axis", "seed=1,2,3,4,5", "--gpus", "0,1",
                 "--runs-per-gpu", "2", "--gpu-memory", "80", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "slots: GPU 0 #1, GPU 1 #1, GPU 0 #2, GPU 1 #2" in out
    assert "[new] seed=1 -> GPU 0 #1" in out and "[new] seed=3 -> GPU 0 #2" in out
    assert "[new] seed=5 -> queued: the next free cuda slot" in out
    threads = max(1, len(os.sched_getaffinity(0)) // 4)  # four processes share the cores
    assert f"CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS={threads} " in out
    need = sum(memory.run_memory(train_gpt.parse_config(["--seed", "1"])).values())
    assert f"memory: about {memory.gib(need)} per run at most (seed=1); 2 per GPU: {memory.gib(2 * need)} of 80.0 GiB" \
        in out


def test_an_n_that_does_not_fit_is_refused_with_the_numbers(tmp_path, capsys):
    args = ["--name", "p", "--run-dir", str(tmp_path), "--axis", "optimizer=adamw,soap", "--gpus", "0",
            "--gpu-memory", "16", "--dry-run"]
    assert main(args + ["--runs-per-gpu", "3"]) == 2
    err = capsys.readouterr().err.strip()
    soap = memory.run_memory(train_gpt.parse_config(["--optimizer", "soap"]))
    need = sum(soap.values())
    assert err == (f"error: --runs-per-gpu 3: 3 runs of about {memory.gib(need)} each (optimizer=soap: parameters "
                   f"{memory.gib(soap['parameters'])}, gradients {memory.gib(soap['gradients'])}, optimizer state "
                   f"{memory.gib(soap['optimizer state'])}, activations {memory.gib(soap['activations'])}, context "
                   f"and slack {memory.gib(soap['context and slack'])}) need {memory.gib(3 * need)}, more than 95% of "
                   f"a GPU's 16.0 GiB; use --runs-per-gpu {int(0.95 * 16 * 2**30 // need)} (docs/grid.md)")
    assert main(args + ["--runs-per-gpu", "1"]) == 0  # one fits
    assert not (tmp_path / "p" / "grid.jsonl").exists()


def test_a_graph_run_is_estimated_with_its_own_copy_of_the_activations():
    default = memory.run_memory(train_gpt.parse_config([]))
    graph = memory.run_memory(train_gpt.parse_config(["--compile-mode", "reduce-overhead"]))
    assert graph["CUDA graph"] == graph["activations"] == default["activations"] > 0 and "CUDA graph" not in default


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_estimate_counts_the_state_an_optimizer_holds_after_its_first_step(name):
    model = tiny_gpt(n_embd=16, block_size=16)
    optimizer = OPTIMIZERS[name].build(model, OPTIMIZERS[name].config())
    estimate = optimizer_state_bytes(optimizer) + optimizer.first_step_state_bytes()
    idx = torch.randint(0, 64, (2, 16))
    loss = model(idx, idx)[1]
    loss.backward()
    optimizer.stage_step()
    optimizer.device_step(loss.detach() if OPTIMIZERS[name].needs_loss else None)  # as the trainer calls it
    optimizer.finish_step()
    assert estimate == optimizer_state_bytes(optimizer) > 0 and optimizer.first_step_state_bytes() == 0


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", [{}, {"activation": "gelu"}, {"bias_mode": "none"},
                                     {"bias_mode": "learned", "bias_per_head": True}, {"objective": "mlm"},
                                     {"attention": "relational", "bias_mode": "none"}], ids=json.dumps)
def test_the_activations_are_what_the_trainers_forward_pass_keeps_on_real_tensors(variant, bf16):
    """The estimate runs the trainer's model on fake tensors (no memory): on real CPU tensors the same forward pass
    keeps exactly those bytes for the backward pass, in fp32 and under the CPU's bf16 autocast, for each model
    variant; a larger micro-batch keeps more."""
    model = tiny_gpt(**variant)
    sizes = memory.saved_tensor_sizes(model, torch.randint(0, model.config.vocab_size, (2, 16)), bf16)
    estimate = memory.activation_bytes(json.dumps(dataclasses.asdict(model.config)), 2, 16, bf16)
    assert estimate == sum(sizes) + max(sizes) > 0
    assert memory.activation_bytes(json.dumps(dataclasses.asdict(model.config)), 4, 16, bf16) > estimate


def test_slots_are_in_the_journal_and_grid_status(tmp_path, corpus, monkeypatch, capsys):
    """A real grid of two tiny runs on one fake GPU (the trainers run on this CPU): both start at once, one per slot."""
    monkeypatch.setattr("grid.__main__.visible_gpus", lambda given: ["0"])
    assert main(["--name", "g", "--run-dir", str(tmp_path), "--axis", "seed=1,2", "--gpus", "0", "--runs-per-gpu",
                 "2", "--gpu-memory", "80", "--no-report", "--status-every", "3600", "--", *tiny(corpus)]) == 0
    records = Journal(tmp_path / "g").records()
    start = next(r for r in records if r.get("event") == "start")
    assert start["runs_per_gpu"] == 2 and start["slots"] == ["GPU 0 #1", "GPU 0 #2"]
    assert all(run["memory_gib"] > 0 for run in start["runs"])
    placements = {r["run"]: r["placement"] for r in records if r.get("state") == "running"}
    assert sorted(placements.values()) == ["GPU 0 #1", "GPU 0 #2"]
    capsys.readouterr()
    assert main(["status", str(tmp_path / "g")]) == 0
    status = capsys.readouterr().out
    assert "2 runs share each GPU (about" in status and "GPU 0 #2" in status and "2 finished" in status
