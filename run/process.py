"""Where a process trains: the process group torchrun asks for, the device and autocast dtype, each rank's share of
the batch, and the GPU's peak for MFU. Importing this module has no side effects."""
from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def init_process_group(backend: str, **kwargs) -> None:
    """`torch.distributed.init_process_group`, with `torch._dynamo` imported first: imported lazily after the group
    exists (by torch.optim or torch.compile), it keeps references to the group that `destroy_process_group` does not
    drop (torch 2.13), so gloo's threads outlive it and abort the process at exit (SIGABRT, "terminate called without
    an active exception")."""
    importlib.import_module("torch._dynamo")
    dist.init_process_group(backend, **kwargs)


def world_size_from_env() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def batch_layout(hp, world: int) -> tuple[int, int]:
    """(micro_batch, grad_accum) of each rank: the largest micro-batch <= --micro-batch that splits the rank's
    share of the global batch evenly, and the number of micro-steps it takes. Raises ValueError (naming the flags
    and a fix) when the batch does not split over the ranks."""
    if hp.batch_tokens % hp.seq_len:
        raise ValueError(f"--batch-tokens {hp.batch_tokens} must be a multiple of --seq-len {hp.seq_len}")
    sequences = hp.batch_tokens // hp.seq_len
    if sequences % world:
        raise ValueError(
            f"--batch-tokens {hp.batch_tokens} is {sequences} sequences of --seq-len {hp.seq_len}, which do not split "
            f"over {world} processes: set --batch-tokens to a multiple of {hp.seq_len} x {world} = "
            f"{hp.seq_len * world}, e.g. {hp.seq_len * world * max(1, round(sequences / world))}")
    per_rank = sequences // world
    micro = max(m for m in range(1, min(hp.micro_batch, per_rank) + 1) if per_rank % m == 0)
    return micro, per_rank // micro


PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}  # for MFU


@dataclass
class Runtime:
    """Where this process trains: its rank among `world`, its device and autocast dtype, and the per-rank batch
    layout (micro_batch sequences per pass, grad_accum passes per step; see batch_layout)."""

    rank: int
    world: int
    device: torch.device
    micro_batch: int
    grad_accum: int
    autocast_dtype: torch.dtype | None

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype else \
            contextlib.nullcontext()

    @property
    def dtype_name(self) -> str:
        """The precision the model computes in: bf16 (autocast) or fp32 (a CPU run, whatever --dtype says)."""
        return "bf16" if self.autocast_dtype == torch.bfloat16 else "fp32"

    def layout(self) -> dict:
        """config.json's "layout": what runs, whatever --device and --dtype asked for."""
        return {"world_size": self.world, "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                "device": self.device.type, "dtype": self.dtype_name}

    def mfu_per_token_s(self, flops_per_token: float) -> float | None:
        """The model FLOPs utilisation of one training token per second on all ranks, from the GPU's datasheet dense
        bf16 peak (None on a CPU or an unknown GPU)."""
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        peak = next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)
        return flops_per_token / (peak * self.world) if peak else None


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device a --device value names, for the trainer and every tool: auto is CUDA where there is a GPU, else
    the CPU; cuda is this process's GPU (cuda:LOCAL_RANK under torchrun). A one-line error (SystemExit) for cuda
    where there is none."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {name}: no CUDA device is available (use --device cpu or auto)")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(f"cuda:{local_rank}" if name == "cuda" else name)


def setup_process(hp) -> Runtime:
    """Process group (torchrun sets RANK/WORLD_SIZE/LOCAL_RANK), device, autocast and the per-rank batch layout of
    the training flags `hp` (train_gpt.TrainConfig)."""
    world = world_size_from_env()
    device = resolve_device(hp.device, int(os.environ.get("LOCAL_RANK", "0")))
    use_cuda = device.type == "cuda"
    micro_batch, grad_accum = batch_layout(hp, world)
    if world > 1:
        init_process_group(backend="nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(device)
    autocast_dtype = torch.bfloat16 if use_cuda and hp.dtype == "bf16" else None
    return Runtime(rank=dist.get_rank() if world > 1 else 0, world=world, device=device, micro_batch=micro_batch,
                   grad_accum=grad_accum, autocast_dtype=autocast_dtype)
