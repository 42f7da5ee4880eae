"""One GPU session in one command: the CUDA tests, the attention benchmark, the optimizer benchmark, sampling with and
without the KV cache and end-to-end training with each attention implementation, into one Markdown report and one
JSON file.

    bash bench/gpu_session.sh                          # writes $OUT/gpu_session.md and .json (OUT: runs/gpu)
    PYTHON=/path/to/venv/bin/python bash bench/gpu_session.sh

Made to finish in under 10 minutes on one H100 or H200: every step runs in its own process group under its own time
limit (STEPS; they sum to less than BUDGET_S, and no step starts past the budget), so a failing or hung step is
reported as such and the others still run. The report is rewritten after every step, so a session cut short still
leaves one. Each step's full output is kept beside it ($OUT/<step>.log). This driver imports no torch: it only starts
the steps, with the interpreter that runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data.shards import atomic_write  # noqa: E402

BUDGET_S = 575
IMPLEMENTATIONS = ("triton", "sdpa", "flex")
E2E_BATCHES = {"paper": [], "32k": ["--micro-batch", "64", "--batch-tokens", "32768"]}  # 8 x 512 tokens, 64 x 512


@dataclasses.dataclass
class Step:
    name: str
    limit_s: int
    argv: list[str]
    result: dict = dataclasses.field(default_factory=dict)


def session_steps(out: Path, python: str) -> list[Step]:
    """The steps in order, each with its time limit (estimates on one H100 in the comments)."""
    e2e = [Step(f"e2e_{batch}_{impl}", 45,  # ~30 s to compile GPT-2 124M, then 25 steps of 8 x 512 or 64 x 512
                [python, "-m", "bench.e2e", "--preset", "gpt2-124m", "--steps", "25", "--log-every", "5",
                 "--out", str(out / f"e2e_{batch}_{impl}.json"), "--", "--attention-impl", impl, *flags])
           for batch, flags in E2E_BATCHES.items() for impl in IMPLEMENTATIONS]
    return [
        Step("env", 10, [python, "-c", ENV_SCRIPT]),
        Step("cuda_tests", 110, [python, "-m", "pytest", "-q", "-m", "cuda", "tests/"]),  # ~60 s, mostly compiles
        Step("attention", 125, [python, "-m", "bench.attention", "--warmup-ms", "25", "--rep-ms", "100",  # ~90 s
                                "--out", str(out / "attention.json")]),
        Step("optim", 40, [python, "-m", "bench.optim", "--optimizers", "ecd,ecd:unfused,soap,adamw",  # ~30 s (est.)
                           "--rounds", "2", "--steps", "10"]),  # SOAP's step at 124M against torch's fused AdamW
        Step("sample", 15, [python, "-m", "bench.sample", "--device", "cuda", "--shapes", "gpt2-124m",  # ~10 s
                            "--max-new-tokens", "200", "--repeats", "1"]),  # generation with and without KV cache
        *e2e,
    ]


ENV_SCRIPT = """
import json, subprocess, torch, triton
def output(*argv):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable ({exc})"
gpu = output("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
print(json.dumps({"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                  "commit": output("git", "rev-parse", "--short", "HEAD"), "cuda_available": torch.cuda.is_available()}))
"""


def run_step(step: Step, out: Path, deadline: float) -> None:
    """Run one step in its own process group, killed at its limit (or at the session's deadline if sooner)."""
    remaining = deadline - time.monotonic()
    limit = min(step.limit_s, remaining)
    log = out / f"{step.name}.log"
    if remaining < 5:
        step.result = {"status": "not run: no time left in the budget", "seconds": 0.0, "limit_s": step.limit_s}
        return
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(step.argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            status = f"timed out after {limit:.0f} s"
    step.result = {"status": status, "seconds": round(time.monotonic() - start, 1), "limit_s": step.limit_s,
                   "log": log.name, "tail": log.read_text(errors="replace")[-2000:]}


def _load_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect(steps: list[Step], out: Path) -> dict:
    """Everything the session measured, as one JSON-ready dict."""
    tails = {s.name: s.result.get("tail", "") for s in steps}
    env_lines = tails.get("env", "").strip().splitlines()
    summary = re.compile(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s")  # pytest's last line
    tests = [line for line in tails.get("cuda_tests", "").splitlines() if summary.search(line)]
    return {
        "env": _load_json_text(env_lines[-1]) if env_lines else None,
        "steps": {s.name: {k: v for k, v in s.result.items() if k != "tail"} for s in steps},
        "cuda_tests": tests[-1].strip("= ") if tests else None,
        "attention": _load_json(out / "attention.json"),
        "optim": tails.get("optim") or None,
        "e2e": {s.name.removeprefix("e2e_"): _load_json(out / f"{s.name}.json") for s in steps
                if s.name.startswith("e2e_")},
    }


def _load_json_text(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def markdown(report: dict) -> str:
    env = report["env"] or {}
    lines = ["# GPU session", "",
             f"GPU: {env.get('gpu', '?')} | torch {env.get('torch', '?')} | Triton {env.get('triton', '?')} | CUDA "
             f"{env.get('cuda', '?')} | commit {env.get('commit', '?')} | {time.strftime('%Y-%m-%d %H:%M')}", "",
             "| step | status | seconds | limit s |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {r.get('status', 'not run')} | {r.get('seconds', '')} | {r.get('limit_s', '')} |"
              for name, r in report["steps"].items()]
    lines += ["", f"CUDA tests: {report['cuda_tests'] or 'no summary line'}"]
    attention = report["attention"]
    if attention:
        lines += ["", "## Attention (forward and forward+backward; x = fastest library path / this, same biases)"]
        for shape in attention["shapes"]:
            lines += ["", f"B={shape['B']} H={shape['H']} T={shape['T']} d={shape['d']} "
                          f"{'causal' if shape['causal'] else 'bidirectional'} {shape['dtype']}; auto picks "
                      + ", ".join(f"{k}: {v}" for k, v in shape["auto"].items()), "",
                      "| variant | fwd ms | x | fwd+bwd ms | x |", "| --- | --- | --- | --- | --- |"]
            for name, r in shape["variants"].items():
                if "error" in r:
                    lines.append(f"| {name} | {r['error'][:80]} | | | |")
                else:
                    lines.append(f"| {name} | {r['fwd_ms']:.3f} | {_x(r.get('x_fwd'))} | {r['fwd_bwd_ms']:.3f} | "
                                 f"{_x(r.get('x_fwd_bwd'))} |")
    e2e = {k: v for k, v in report["e2e"].items() if v}
    if e2e:
        lines += ["", "## End-to-end training (gpt2-124m, AdamW, bf16, torch.compile)", "",
                  "| batch | attention | tokens/s | step ms | MFU |", "| --- | --- | --- | --- | --- |"]
        for name, r in e2e.items():
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
            lines.append(f"| {name.split('_')[0]} ({r['batch_tokens']:,} tokens) | {name.split('_')[1]} | "
                         f"{r['tokens_per_s']:,.0f} | {r['step_time_ms']:.1f} | {mfu} |")
    if report["optim"]:
        lines += ["", "## Optimizer step (fused ECD, unfused ECD, torch fused AdamW; floor = HBM bytes / copy "
                      "bandwidth)", "", "```", report["optim"].strip(), "```"]
    return "\n".join(lines) + "\n"


def _x(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "n/a"


def write_report(steps: list[Step], out: Path) -> None:
    report = collect(steps, out)
    atomic_write(out / "gpu_session.json", json.dumps(report, indent=2).encode())
    atomic_write(out / "gpu_session.md", markdown(report).encode())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "runs/gpu"),
                        help="directory for the report, the JSON and each step's log (default: $OUT or runs/gpu)")
    parser.add_argument("--only", nargs="+", default=None, help="run only these steps (names as in the report)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps = session_steps(out, sys.executable)
    unknown = set(args.only or ()) - {s.name for s in steps}
    if unknown:
        raise SystemExit(f"--only: no step named {', '.join(sorted(unknown))}; steps: "
                         f"{', '.join(s.name for s in steps)}")
    deadline = time.monotonic() + BUDGET_S
    for step in steps:
        if args.only is None or step.name in args.only:
            print(f"[{step.name}] limit {step.limit_s} s", flush=True)
            run_step(step, out, deadline)
            print(f"[{step.name}] {step.result['status']} ({step.result['seconds']} s)", flush=True)
        write_report(steps, out)
    print(f"report: {out / 'gpu_session.md'}  data: {out / 'gpu_session.json'}")


if __name__ == "__main__":
    main()
