"""The recipe for adding an optimizer (docs/optimizers.md#adding-an-optimizer) is a tested example: the page's module,
built exactly as written and registered as the page says, trains with the interface's defaults (the gradient clipped
and its norm logged), checkpoints and resumes bit-exactly, and a CUDA graph of its step is refused with the reason
named, in the trainer's log and on a CUDA device stood in for on the CPU; its constructor gives the command line's
error for a bad value. And for every registered optimizer the trainer's step calls the update, never the reverse."""
from __future__ import annotations

import importlib.util
import math
import re
import sys
from types import ModuleType

import pytest
import torch

import train_gpt
from optim import OPTIMIZERS
from optim.registry import OptimizerSpec
from run import capture
from run.log import read_log
from run.process import Runtime
from tests.helpers import ROOT, FakeCuda, resume_in_new_directory, tiny_args, tiny_gpt, train_losses

PAGE = ROOT / "docs" / "optimizers.md"


def recipe_module(tmp_path, monkeypatch) -> ModuleType:
    """The ```python block of the page's section "Adding an optimizer", written to a file and imported as the module
    it describes (optim/<name>.py)."""
    section = PAGE.read_text().split("\n## Adding an optimizer\n")[1].split("\n## ")[0]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.M | re.S)
    assert len(blocks) == 1, f"{PAGE}: the recipe has {len(blocks)} python blocks, not one"
    path = tmp_path / "recipe.py"
    path.write_text(blocks[0])
    spec = importlib.util.spec_from_file_location("optim.recipe", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "optim.recipe", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def recipe(tmp_path, monkeypatch) -> OptimizerSpec:
    """The page's optimizer, listed in OPTIMIZERS as the page says (for this test only)."""
    specs = [value for value in vars(recipe_module(tmp_path, monkeypatch)).values() if isinstance(value, OptimizerSpec)]
    assert len(specs) == 1 and specs[0].name not in OPTIMIZERS
    monkeypatch.setitem(OPTIMIZERS, specs[0].name, specs[0])
    return specs[0]


def run_args(corpus, tmp_path, name: str, spec: OptimizerSpec, **overrides) -> list[str]:
    """Six steps of a changing learning rate with the gradient clipped, trained by the recipe's optimizer."""
    return tiny_args(corpus, tmp_path, name, optimizer=spec.name, steps=6, lr=3e-3, **{
        "lr-schedule": "cosine", "warmup-steps": 2, "grad-clip": 0.1, "val-every": 0, **overrides})


def test_the_recipes_optimizer_trains_checkpoints_resumes_bit_exactly_and_is_refused_a_cuda_graph(corpus, tmp_path,
                                                                                                 recipe):
    train_gpt.main(run_args(corpus, tmp_path, "straight", recipe))
    train_gpt.main(run_args(corpus, tmp_path, "halves", recipe, **{"checkpoint-every": 3, "keep-checkpoints": -1}))
    resumed = resume_in_new_directory(tmp_path / "halves/checkpoints/step_000003.pt", tmp_path / "resumed")
    straight, again = train_losses(tmp_path / "straight"), train_losses(resumed)
    assert len(set(straight.values())) == 6 and all(math.isfinite(v) for v in straight.values())  # the run moves
    assert sorted(again) == [4, 5, 6] and all(again[step] == straight[step] for step in again), (again, straight)
    norms = [r["grad_norm"] for r in read_log(tmp_path / "straight") if "grad_norm" in r]
    assert len(norms) == 6 and all(n > 0.1 for n in norms)  # clipped by the default device_step, the norm before

    train_gpt.main(run_args(corpus, tmp_path, "graph", recipe, **{"compile-mode": "reduce-overhead"}))
    name = recipe.optimizer.__name__
    reason = f"{name} does not declare its step replayable"
    lines = [line for line in (tmp_path / "graph" / "log.txt").read_text().splitlines() if "no CUDA graph" in line]
    assert len(lines) == 1 and reason in lines[0] and lines[0].endswith("the step runs in the default mode")
    assert train_losses(tmp_path / "graph") == straight
    assert f"`{name} does not declare its step replayable ...`" in PAGE.read_text()  # the page quotes the reason


def test_on_a_cuda_device_stood_in_for_the_recipes_step_is_never_captured(recipe, monkeypatch):
    cuda, lines = FakeCuda(), []
    cuda.install(monkeypatch)
    model = tiny_gpt()
    optimizer = recipe.build(model, recipe.config(lr=1e-3))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(x):
        loss = model(x, x)[1]
        loss.backward()
        optimizer.device_step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    on_cuda = Runtime(rank=0, world=1, device=torch.device("cuda"), micro_batch=2, grad_accum=1, autocast_dtype=None)
    run_step = capture.graph_step(step, optimizer, on_cuda, mode="reduce-overhead", step_tools=[],
                                  log_line=lines.append)
    losses = [run_step(idx).item() for _ in range(2 + capture.WARMUP_STEPS)]
    assert run_step is step and cuda.events == [] and losses[-1] < losses[0]
    assert lines == [f"--compile-mode reduce-overhead: no CUDA graph: {optimizer.capture_problem()}; the step runs "
                     "in the default mode"] and "\n" not in lines[0]


def test_the_recipes_constructor_gives_the_command_lines_error(recipe):
    model = tiny_gpt()
    with pytest.raises(ValueError, match=rf"^{recipe.optimizer.__name__}: --beta1 must be \[0, 1\), got 1.0$"):
        recipe.optimizer(recipe.groups(model, recipe.config()), beta1=1.0)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_trainers_step_calls_the_update_and_the_update_never_calls_back(name):
    """The trainer's device_step reaches the update (step(), or a sharded optimizer's update) once, and step() (what
    every other caller runs) never reaches device_step."""
    spec, model = OPTIMIZERS[name], tiny_gpt()
    optimizer = spec.build(model, spec.config())
    calls = []

    def recorded(method: str, call):
        def record(*args, **kwargs):
            calls.append(method)
            return call(*args, **kwargs)
        return record

    for method in ("stage_step", "device_step", "finish_step", "step", "update"):
        if hasattr(optimizer, method):
            setattr(optimizer, method, recorded(method, getattr(optimizer, method)))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for parts in (False, True):
        calls.clear()
        loss = model(idx, idx)[1]
        loss.backward()
        if parts:  # as the trainer steps
            optimizer.stage_step()
            optimizer.device_step(loss.detach() if spec.needs_loss else None)
            optimizer.finish_step()
            update = "update" if hasattr(optimizer, "update") else "step"
            assert calls == ["stage_step", "device_step", update, "finish_step"], calls
        else:
            optimizer.step(loss.detach()) if spec.needs_loss else optimizer.step()
            assert "device_step" not in calls and calls[0] == "step", calls
        optimizer.zero_grad(set_to_none=True)
