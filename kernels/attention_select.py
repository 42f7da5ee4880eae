"""Which attention implementation a training run uses: --attention-impl auto|triton|sdpa|flex
(docs/model.md#choosing-the-implementation).

The three implementations in kernels/attention.py compute the same function (exactly, up to rounding): the Triton
kernel, SDPA on q + b_Q with b_V added to the output, and FlexAttention with b_Q as a per-key score term. Which is
fastest depends on the GPU, the software and the shape, so `auto` measures instead of guessing. Once per run, before
torch.compile (which then sees one fixed choice), rank 0 times each candidate's forward+backward on the run's own
attention call (`AttentionCall`: micro-batch, heads, length, head dim, dtype, mask, biases; CUDA events after warm-up
calls that also compile), checks its output against SDPA, takes the fastest, and broadcasts the choice so every rank
runs the same code. The measurement is cached per (GPU, torch, Triton, kernel source, call, compiled or not) in the
cache directory (data.shards.cache_root), so the next run on the machine starts at once.

A candidate that cannot run here is skipped with its reason: the Triton kernel off CUDA or outside fp16/bf16 and head
dims 64/128, FlexAttention on the CPU (no backward) or in a model that is not compiled; so is one that raises (a
compilation error) or returns a wrong output. A single candidate left (every CPU run: SDPA) is chosen without
timing. $SYMGPT_ATTENTION_IMPL, when set, overrides the flag. A resumed run selects again (its checkpoint's request
is kept; under auto the cache answers on the same machine, another GPU measures anew): the choice changes only
rounding, never what is computed.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import triton

from data.shards import atomic_write, cache_root
from kernels.attention import (IMPLEMENTATIONS, attention_flex, attention_reference, attention_triton,
                               kernel_problem)

CHOICES = ("auto", *IMPLEMENTATIONS)
ENV = "SYMGPT_ATTENTION_IMPL"
CACHE_FILE = "attention_impl.json"
PREFERENCE = ("sdpa", "triton", "flex")  # among timings within TIE of the fastest, the earliest wins: the library
TIE = 0.02
OUTPUT_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # ‖out − SDPA‖ / ‖SDPA‖
IMPLEMENTATION_FNS = {"triton": attention_triton, "sdpa": attention_reference, "flex": attention_flex}


class Unavailable(ValueError):
    """The implementation asked for (flag or environment) cannot run here: a refusal that names the fix."""

AttentionFn = Callable[..., torch.Tensor]  # f(q, k, v, b_q, b_v, causal) -> (B, H, T, d)
Timer = Callable[[str, Callable[[], None]], float]  # (candidate, one forward+backward) -> milliseconds per call


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """The attention call of one training micro-step: q, k, v of shape (batch, heads, seq_len, head_dim) in `dtype`,
    causal or not, b_Q and b_V each "none", "shared" (d,) or "head" (H, d), learned (trainable) or sampled."""

    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    b_q: str = "none"
    b_v: str = "none"
    learned: bool = False

    @classmethod
    def of_model(cls, config, batch: int, seq_len: int, dtype: torch.dtype) -> AttentionCall | None:
        """The call a model of `config` (train_gpt.GPTConfig: attention, n_head, head_dim, objective, bias_mode,
        bias_per_head, sampled_biases) makes; None for attention without queries and keys (relational)."""
        if config.attention != "standard":
            return None
        learned = config.bias_mode == "learned"
        uses_q, _, uses_v = config.sampled_biases
        kind = "head" if config.bias_per_head else "shared"
        return cls(batch, config.n_head, seq_len, config.head_dim, dtype, config.objective == "clm",
                   kind if uses_q or learned else "none", kind if uses_v or learned else "none", learned)

    def describe(self) -> str:
        biases = "no biases" if self.b_q == self.b_v == "none" else (
            f"{'learned' if self.learned else 'sampled'} b_Q {self.b_q}, b_V {self.b_v}")
        return (f"{self.batch}x{self.heads}x{self.seq_len}x{self.head_dim} {str(self.dtype).removeprefix('torch.')} "
                f"{'causal' if self.causal else 'bidirectional'}, {biases}")

    def inputs(self, device: torch.device, seed: int = 0) -> tuple[list[torch.Tensor], list, torch.Tensor]:
        """(leaves, the biases [b_q, b_v], output gradient): one (B, T, 3·H·d) leaf that q, k, v are views of, as
        the model's QKV projection lays them out, plus the biases when learned."""
        gen = torch.Generator(device=device).manual_seed(seed)
        B, H, T, d = self.batch, self.heads, self.seq_len, self.head_dim
        qkv = torch.randn(B, T, 3 * H * d, device=device, generator=gen).to(self.dtype).requires_grad_()
        biases = []
        for kind, mean in ((self.b_q, 0.5), (self.b_v, 0.0)):
            shape = {"none": None, "shared": (d,), "head": (H, d)}[kind]
            biases.append(None if shape is None else (mean + 0.1 * torch.randn(shape, device=device, generator=gen)
                                                      ).requires_grad_(self.learned))
        grad_out = torch.randn(B, T, H * d, device=device, generator=gen).to(self.dtype)
        return [qkv] + [b for b in biases if b is not None and b.requires_grad], biases, grad_out


def split_heads(qkv: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """q, k, v as (B, H, T, d) views of the (B, T, 3·H·d) projection, as the model makes them."""
    B, T, C3 = qkv.shape
    return [t.view(B, T, heads, C3 // (3 * heads)).transpose(1, 2) for t in qkv.split(C3 // 3, dim=2)]


def forward_backward(fn: AttentionFn, call: AttentionCall, device: torch.device) -> Callable[[], None]:
    """One training micro-step's attention work with `fn`: the forward from the projection's views to the (B, T, C)
    output the model's c_proj reads, and its backward. Checks the output against SDPA first (raises ValueError when
    it differs by more than OUTPUT_TOLERANCE); this first call also compiles."""
    leaves, (b_q, b_v), grad_out = call.inputs(device)

    def run() -> torch.Tensor:
        q, k, v = split_heads(leaves[0], call.heads)
        out = fn(q, k, v, b_q, b_v, call.causal)
        return out.transpose(1, 2).contiguous().view(call.batch, call.seq_len, -1)

    with torch.no_grad():
        got = run().float()
        q, k, v = (x.float() for x in split_heads(leaves[0], call.heads))
        want = attention_reference(q, k, v, b_q, b_v, call.causal).transpose(1, 2).reshape(got.shape)
    error = ((got - want).norm() / want.norm()).item()
    if not error <= OUTPUT_TOLERANCE[call.dtype]:
        raise ValueError(f"its output differs from SDPA's by {error:.2e} (relative), more than the "
                         f"{OUTPUT_TOLERANCE[call.dtype]:g} allowed for {call.dtype}")

    def step() -> None:
        torch.autograd.grad(run(), leaves, grad_out)

    step()
    return step


def time_ms(step: Callable[[], None], device: torch.device, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of `step` over `reps` calls after `warmup` (CUDA events on a GPU, the clock elsewhere)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            times.append((start, end))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in times]
    return statistics.median(times)


def candidate_problem(name: str, call: AttentionCall, device: torch.device, compiled: bool) -> str | None:
    """Why implementation `name` cannot serve `call` in this run; None when it can."""
    if name == "triton":
        return kernel_problem(device.type, call.dtype, call.head_dim)
    if name == "flex":
        if device.type != "cuda":
            return f"FlexAttention has no backward pass on {device.type} (torch {torch.__version__})"
        if not compiled:
            return "FlexAttention needs torch.compile and this model runs eagerly (--no-compile)"
    return None


def fastest(timings: Mapping[str, float]) -> str:
    """The fastest candidate; timings within TIE (relative) of the best count as ties, won by PREFERENCE order."""
    best = min(timings.values())
    tied = [name for name, ms in timings.items() if ms <= best * (1 + TIE)]
    return min(tied, key=lambda name: PREFERENCE.index(name) if name in PREFERENCE else len(PREFERENCE))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def measure(candidates: Mapping[str, AttentionFn], call: AttentionCall, device: torch.device,
            timer: Timer) -> tuple[dict[str, float], dict[str, str]]:
    """(milliseconds per forward+backward, reasons of the candidates that failed) for each candidate."""
    timings, failed = {}, {}
    for name, fn in candidates.items():
        try:
            timings[name] = timer(name, forward_backward(fn, call, device))
        except Exception as exc:  # a compilation error, a launch failure, a wrong output: skip it, say why
            failed[name] = _first_line(exc)
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return timings, failed


@functools.cache
def _kernel_digest() -> str:
    """A digest of kernels/attention.py: an edited kernel invalidates the cached measurements."""
    return hashlib.sha256(Path(__file__).with_name("attention.py").read_bytes()).hexdigest()[:12]


def cache_key(call: AttentionCall, device: torch.device, compiled: bool) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return (f"{gpu} | torch {torch.__version__} | triton {triton.__version__} | kernel {_kernel_digest()} | "
            f"{call.describe()} | {'compiled' if compiled else 'eager'}")


def _read_cache(path: Path) -> tuple[dict, str | None]:
    """(entries, a note when the file exists but cannot be used)."""
    if not path.is_file():
        return {}, None
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            raise ValueError("not a JSON object")
        return entries, None
    except (OSError, ValueError) as exc:
        return {}, f"attention: ignoring the unreadable cache {path} ({_first_line(exc)}); measuring again"


def _resolve_request(requested: str, env: Mapping[str, str]) -> tuple[str, str]:
    """(implementation requested, where the request came from): $SYMGPT_ATTENTION_IMPL overrides the flag."""
    if env.get(ENV):
        if env[ENV] not in CHOICES:
            raise Unavailable(f"${ENV}={env[ENV]!r} is not one of {', '.join(CHOICES)}; unset it or pick one")
        return env[ENV], f"${ENV}"
    if requested not in CHOICES:
        raise Unavailable(f"--attention-impl {requested!r} is not one of {', '.join(CHOICES)}")
    return requested, "--attention-impl"


def _broadcast_from_rank0(record: dict | None) -> dict:
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [record]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return record


def choose(requested: str, call: AttentionCall | None, device: torch.device, *, compiled: bool, rank: int = 0,
           candidates: Mapping[str, AttentionFn] | None = None, timer: Timer | None = None,
           cache: Path | None = None, env: Mapping[str, str] = os.environ,
           broadcast: Callable[[dict | None], dict] = _broadcast_from_rank0) -> dict:
    """Rank 0 decides (see the module docstring) and `broadcast` hands its record to every rank; other ranks compute
    nothing (and raise when rank 0 could not decide, rather than wait). The record: requested, choice, source (how it
    was decided), the call, the timings in milliseconds, the skipped candidates with their reasons, notes, and the
    seconds the decision took. `candidates` (default: the implementations that can run here) and `timer` (default:
    time_ms) are for tests."""
    record: dict | None = None
    if rank == 0:
        try:
            record = _decide(requested, call, device, compiled, candidates, timer, cache, env)
        except Exception as exc:
            broadcast({"error": str(exc), "refused": isinstance(exc, Unavailable)})
            raise
    record = broadcast(record)
    if record.get("refused"):  # every rank exits with rank 0's one-line refusal
        raise Unavailable(record["error"])
    if "error" in record:
        raise RuntimeError(f"rank 0 could not choose the attention implementation: {record['error']}")
    return record


def _decide(requested: str, call: AttentionCall | None, device: torch.device, compiled: bool,
            candidates: Mapping[str, AttentionFn] | None, timer: Timer | None, cache: Path | None,
            env: Mapping[str, str]) -> dict:
    start = time.perf_counter()
    requested, origin = _resolve_request(requested, env)
    record: dict = {"requested": requested, "choice": None, "source": None, "call": None, "timings_ms": {},
                    "skipped": {}, "notes": []}
    if call is None:
        record["source"] = "the model has no dot-product attention"
    else:
        record["call"] = call.describe()
        if candidates is None:
            candidates = {}
            for name in PREFERENCE:
                problem = candidate_problem(name, call, device, compiled)
                if problem is None:
                    candidates[name] = IMPLEMENTATION_FNS[name]
                else:
                    record["skipped"][name] = problem
        if requested != "auto":
            if requested not in candidates:
                raise Unavailable(f"{origin} {requested}: {record['skipped'].get(requested, 'not available here')}; "
                                 f"use auto or one of {', '.join(candidates)}")
            record.update(choice=requested, source=origin)
        elif len(candidates) == 1:
            record.update(choice=next(iter(candidates)), source="the only candidate")
        else:
            _choose_by_timing(record, call, device, compiled, candidates, timer, cache or cache_root() / CACHE_FILE)
    record["seconds"] = round(time.perf_counter() - start, 6)
    return record


def _choose_by_timing(record: dict, call: AttentionCall, device: torch.device, compiled: bool,
                      candidates: Mapping[str, AttentionFn], timer: Timer | None, cache: Path) -> None:
    """Fill `record` from the cache entry of this key, else from a measurement (then cached)."""
    key = cache_key(call, device, compiled)
    entries, note = _read_cache(cache)
    if note:
        record["notes"].append(note)
    hit = entries.get(key)
    if hit is not None and not _entry_well_formed(hit):
        record["notes"].append(f"attention: ignoring the malformed entry for this call in the cache {cache}; "
                               "measuring again")
    elif hit is not None and hit["choice"] in candidates:
        record.update(choice=hit["choice"], source=f"cached measurement of {hit.get('measured', '?')} ({cache})",
                      timings_ms=hit.get("timings_ms", {}))
        record["skipped"].update(hit.get("failed", {}))
        return
    timings, failed = measure(candidates, call, device, timer or (lambda name, step: time_ms(step, device)))
    record["skipped"].update(failed)
    if not timings:
        raise RuntimeError(f"attention: no implementation ran for {call.describe()}: "
                           + "; ".join(f"{k}: {v}" for k, v in record["skipped"].items()))
    record.update(choice=fastest(timings), source="measured", timings_ms={k: round(v, 4) for k, v in timings.items()})
    entries[key] = {"choice": record["choice"], "timings_ms": record["timings_ms"], "failed": failed,
                    "measured": time.strftime("%Y-%m-%d %H:%M")}
    try:
        atomic_write(cache, json.dumps(entries, indent=1).encode())
    except OSError as exc:  # a read-only cache directory costs the next run a measurement, nothing more
        record["notes"].append(f"attention: could not write the cache {cache} ({_first_line(exc)})")


def _entry_well_formed(entry: object) -> bool:
    """Whether a cache entry has the types _choose_by_timing writes (an edited or damaged one may not): a choice,
    milliseconds per candidate, reasons per failed candidate, the time of the measurement."""
    timings = entry.get("timings_ms", {}) if isinstance(entry, dict) else None
    failed = entry.get("failed", {}) if isinstance(entry, dict) else None
    return (isinstance(entry, dict) and isinstance(entry.get("choice"), str) and isinstance(timings, dict)
            and all(isinstance(ms, (int, float)) and not isinstance(ms, bool) for ms in timings.values())
            and isinstance(failed, dict) and all(isinstance(reason, str) for reason in failed.values())
            and isinstance(entry.get("measured", ""), str))


def summary_line(record: dict) -> str:
    """One line for log.txt: the choice, how it was made and every candidate's time or reason."""
    if record["choice"] is None:
        return f"attention: nothing to choose ({record['source']})"
    parts = [f"{name} {ms:.3f} ms" for name, ms in sorted(record["timings_ms"].items(), key=lambda kv: kv[1])]
    parts += [f"{name}: {reason}" for name, reason in record["skipped"].items()]
    timed = " forward+backward" if record["timings_ms"] else ""
    return (f"attention: {record['choice']} ({record['source']}; {record['call']}{timed}"
            + (": " + "; ".join(parts) if parts else "") + f"; {1e3 * record['seconds']:.2f} ms to decide)")


def set_implementation(model: torch.nn.Module, impl: str) -> None:
    """Set `attention_impl` (a plain attribute the attention modules pass to kernels.attention.attention) on every
    module of `model` that has one."""
    for module in model.modules():
        if hasattr(module, "attention_impl"):
            module.attention_impl = impl


def configure(model: torch.nn.Module, requested: str, *, batch: int, seq_len: int, device: torch.device,
              dtype: torch.dtype | None, compiled: bool, rank: int, log: Callable[[str], None]) -> dict:
    """The trainer's entry point: choose for `model`'s attention call (dtype None: float32), set it on the model,
    log the summary line (and any notes); returns the record for config.json."""
    call = AttentionCall.of_model(model.config, batch, seq_len, dtype or torch.float32)
    record = choose(requested, call, device, compiled=compiled, rank=rank)
    if record["choice"] is not None:
        set_implementation(model, record["choice"])
    for note in record["notes"]:
        log(note)
    log(summary_line(record))
    return record
