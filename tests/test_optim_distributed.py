"""Owner-computes sharding: 2 gloo ranks equal 1 process for ECD, SOAP and Muon (also with gradient clipping, and
with gradient accumulation whose last backward pass starts the reductions), and checkpoints move across world sizes
(a state saved by 2 ranks, resumed in 1 process, continues the 2-rank trajectory)."""
from __future__ import annotations

import contextlib
import gc
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from run.process import init_process_group
from optim.ecd import ECD
from optim.muon import Muon
from optim.soap import SOAP

pytestmark = pytest.mark.serial  # the module's fixture spawns two ranks

STEPS, SAVE_AT, WORLD = 10, 5, 2


class Net(nn.Module):
    """Three matrices whose rotated sides have full-rank Grams (docs/optimizers.md#soap numerics) and three biases.

    Sizes are chosen so that on 2 ranks element regions split a tensor across the rank boundary (ECD: l2.weight;
    SOAP/Muon biases: l2.bias) and each rank owns a matrix in the tensor regions.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = nn.Linear(10, 7), nn.Linear(7, 7), nn.Linear(7, 12)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def make(name: str, model: nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    matrices = [p for n, p in named if p.dim() == 2]
    vectors = [p for n, p in named if p.dim() == 1]
    if name.startswith("ecd"):
        groups = [{"params": matrices, "weight_decay": 0.02}, {"params": vectors, "weight_decay": 0.0}]
        projection = "per_tensor" if name == "ecd_per_tensor" else "global"
        return ECD(groups, lr=0.05, ecd_eta=4.0, ecd_f0=0.0, ecd_nu=0.2, ecd_projection=projection, optim_seed=3)
    if name == "soap":
        groups = [{"params": matrices, "weight_decay": 0.01}, {"params": vectors, "weight_decay": 0.0}]
        return SOAP(groups, lr=0.01, beta1=0.9, beta2=0.95, soap_precondition_frequency=3, soap_max_precond_dim=8)
    return Muon([{"params": matrices, "use_muon": True, "lr": 0.02, "weight_decay": 0.01},
                 {"params": vectors, "use_muon": False}], lr=3e-3)


NAMES = ["ecd_global", "ecd_per_tensor", "soap", "muon"]
VARIANTS = {"clipped": {"clip": 0.05}, "accumulated": {"micro_steps": 2}, "in_step": {"overlap": False},
            "after_partial_backward": {"partial_backward": True}}


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(200 + step)
    x = torch.randn(32, 10, generator=gen, dtype=torch.float64)
    y = torch.randn(32, 12, generator=gen, dtype=torch.float64)
    rows = slice(rank * 32 // world, (rank + 1) * 32 // world)
    return x[rows], y[rows]


def train(name, model, opt, steps, first=0, rank=0, world=1, on_step=None, micro_steps=1, clip=0.0, overlap=True,
          partial_backward=False):
    """Returns how many reductions the last backward pass had started before step() (0 on one process).
    partial_backward: first a discarded backward pass that reaches only l1 (a bucket left half ready)."""
    opt.grad_clip, opt.overlap_reduce = clip, overlap
    if partial_backward:
        model.l1(batch(0, rank, world)[0]).square().mean().backward()
        opt.zero_grad()
    for step in range(first, first + steps):
        if on_step:
            on_step(step, model, opt)
        opt.zero_grad()
        x, y = batch(step, rank, world)
        total = 0.0
        for micro, (xm, ym) in enumerate(zip(x.chunk(micro_steps), y.chunk(micro_steps))):
            with opt.no_sync() if micro < micro_steps - 1 else contextlib.nullcontext():
                loss = (model(xm) - ym).square().mean() / micro_steps
                loss.backward()
            total += loss.detach()
        started = sum(len(region._works) for region in opt.regions)
        opt.step(total) if name.startswith("ecd") else opt.step()
    return started


def interface_after_training(opt: torch.optim.Optimizer) -> dict:
    """What optim.base.OptimizerInterface reports after training, and the first moments after writing them back
    doubled (collectives: every rank calls it)."""
    moments = {name: value.clone() for name, value in opt.first_moments().items()}
    steering = sorted(opt.first_moments(steering_only=True))
    velocity = opt.velocity() if opt.has_velocity else None
    opt.set_first_moments({name: 2 * value for name, value in moments.items()})
    doubled = {name: value.clone() for name, value in opt.first_moments().items()}
    return {"moments": moments, "steering": steering, "velocity": velocity, "doubled": doubled}


def thread_names() -> list[str]:
    return [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]


def worker(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD)
    for name in NAMES:
        model = Net()
        opt = make(name, model)

        def save(step, model, opt):
            if step == SAVE_AT:
                state = opt.state_dict()  # collective: every rank calls it
                if rank == 0:
                    torch.save({"model": model.state_dict(), "opt": state}, Path(out) / f"{name}_ckpt.pt")

        started = {"plain": train(name, model, opt, STEPS, rank=rank, world=WORLD, on_step=save)}
        if rank == 0:
            torch.save(model.state_dict(), Path(out) / f"{name}_final.pt")
        interface = interface_after_training(opt)
        if rank == 0:
            torch.save(interface, Path(out) / f"{name}_interface.pt")
        for variant, kwargs in VARIANTS.items():
            model = Net()
            started[variant] = train(name, model, make(name, model), STEPS, rank=rank, world=WORLD, **kwargs)
            if rank == 0:
                torch.save(model.state_dict(), Path(out) / f"{name}_{variant}_final.pt")
        if rank == 0:
            (Path(out) / f"{name}_started.json").write_text(json.dumps(started))
    dist.destroy_process_group()
    gc.collect()
    (Path(out) / f"threads_after_destroy_{rank}.json").write_text(json.dumps(thread_names()))


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two_ranks")
    mp.spawn(worker, args=(str(out),), nprocs=WORLD)
    return out


def assert_same(a: dict, b: dict, tol: float) -> None:
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=tol, msg=key)


TOLERANCE = {"ecd_global": 1e-10, "ecd_per_tensor": 1e-10, "soap": 1e-9, "muon": 1e-5}


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_equal_one_process(two_rank_results, name):
    model = Net()
    train(name, model, make(name, model), STEPS)
    start = Net().state_dict()
    assert max((model.state_dict()[k] - start[k]).abs().max() for k in start) > 1e-2  # the run moved
    assert_same(model.state_dict(), torch.load(two_rank_results / f"{name}_final.pt"), TOLERANCE[name])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_equal_one_process_with_clipping_and_accumulation(two_rank_results, name, variant):
    model = Net()
    opt = make(name, model)
    train(name, model, opt, STEPS, **VARIANTS[variant])
    if variant == "clipped":
        assert opt.grad_norm is not None and opt.grad_norm > 0.05  # the clip was active
    assert_same(model.state_dict(), torch.load(two_rank_results / f"{name}_{variant}_final.pt"), TOLERANCE[name])


@pytest.mark.parametrize("name", NAMES)
def test_reductions_start_during_the_last_backward_pass(two_rank_results, name):
    """Every region's reduction was launched by the backward hooks before step() (as DDP's all-reduce is)."""
    model = Net()
    opt = make(name, model)
    expected = sum(len(r.indices) if r.tensor_owned else 1 for r in opt.regions)
    started = json.loads((two_rank_results / f"{name}_started.json").read_text())
    assert started["plain"] == started["accumulated"] == started["clipped"] == expected > 0
    assert started["in_step"] == 0  # overlap off: step() starts every reduction


@pytest.mark.parametrize("name", NAMES)
def test_first_moments_and_velocity_of_two_ranks_equal_one_process(two_rank_results, name):
    """The sharded state, gathered for the gauge tools and written back, is the state of one process."""
    model = Net()
    opt = make(name, model)
    train(name, model, opt, STEPS)
    one, two = interface_after_training(opt), torch.load(two_rank_results / f"{name}_interface.pt")
    assert one["steering"] == two["steering"] and (one["velocity"] is None) == (two["velocity"] is None)
    assert len(one["moments"]) == (0 if name == "soap" else len(list(model.parameters())))
    for key in ("moments", "doubled", "velocity"):
        assert_same(one[key] or {}, two[key] or {}, TOLERANCE[name])
    assert_same(two["doubled"], {name: 2 * value for name, value in two["moments"].items()}, 0.0)


def test_clipping_scales_the_averaged_gradient_to_the_bound():
    model = Net()
    opt = make("soap", model)
    x, y = batch(0, 0, 1)
    (model(x) - y).square().mean().backward()
    norm = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters()))
    opt.grad_clip = float(norm) / 4
    grads = opt.reduced_gradients()
    torch.testing.assert_close(opt.grad_norm, norm)
    clipped = torch.sqrt(sum(g.square().sum() for g in grads))
    torch.testing.assert_close(clipped, norm / 4, rtol=1e-5, atol=0)


def test_destroy_process_group_stops_the_gloo_threads(two_rank_results):
    """Gloo threads alive after destroy_process_group can abort the process at exit (see init_process_group)."""
    for rank in range(WORLD):
        names = json.loads((two_rank_results / f"threads_after_destroy_{rank}.json").read_text())
        assert names and not [n for n in names if "gloo" in n], names


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_from_two_ranks_resumes_in_one_process(two_rank_results, name):
    ckpt = torch.load(two_rank_results / f"{name}_ckpt.pt")
    model = Net()
    opt = make(name, model)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    train(name, model, opt, STEPS - SAVE_AT, first=SAVE_AT)
    assert_same(model.state_dict(), torch.load(two_rank_results / f"{name}_final.pt"), TOLERANCE[name])
