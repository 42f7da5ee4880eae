"""One GPU session in one command of at most 10 minutes, whose only results are 3 small files and the output's tail.

    SYMGPT_COMMIT=$(git rev-parse HEAD) timeout 590 bash bench/gpu_session.sh     # OUT=DIR, default runs/gpu
    PYTHON=/opt/torch/.venv/bin/python3 bash bench/gpu_session.sh --budget 300 --only attention cuda_tests

The steps, in order of value, each given what is left of one budget counted from the start (--budget) and at most
its own cap (STEPS):
  env           the interpreter ($PYTHON, else the first of python3, python whose torch sees CUDA), torch, the GPU, a
                bf16 matrix product and a Triton kernel (bench/session_env.py); a failure ends the session
  attention     bench.attention at the paper's 8x12x512x64, forward and forward+backward, writing this GPU's row of
                the attention table into a copy (the report's diff); the later runs take the path it chose
  e2e_kernels   bench.e2e of gpt2-124m at the paper's batch (8 x 512 tokens, AdamW) in the default compile mode,
                with a profile of two steps: host time, device time, the top kernels
  e2e_graph     the same with --compile-mode reduce-overhead (the step replayed from a CUDA graph)
  concurrent_2  two such runs at once on the GPU, in the faster of the two modes: the GPU's tokens/s over the
                seconds they overlapped (their log records' wall times, bench/throughput.py)
  concurrent_3  three at once
  cuda_tests    every test marked cuda, the CUDA-graph and fused ECD kernel tests first, each under its own limit
                (--test-limit), with a verdict per test even when the step is cut
Left out to make room (LEFT_OUT), most valuable first: the end-to-end run with SDPA attention (the attention step
compares the paths and the runs take its choice), the attention shape 16x12x1024x64, the optimizer steps against the
memory floor (bench.optim; the profiles show the optimizer's kernels), and the 64 x 512 tokens-per-step run.

Writes $OUT/report.md, $OUT/report.json (both rewritten after every step) and $OUT/session.log (every step's output)
and prints the report last, so the output's tail alone carries the numbers; the report ends with the changes its
numbers justify as one diff (bench/session_report.py). The commit comes from $SYMGPT_COMMIT, else a file
SYMGPT_COMMIT in the repository root, else git. SIGTERM (an outer `timeout`) stops the step in progress and still
writes and prints the report. The driver uses only the standard library, so any python3 runs it; the steps run under
the interpreter the environment check chose.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench.session_report import E2E_MODES, faster_mode, markdown
from bench.throughput import concurrent_tokens_per_s
from cli import ArgumentParser
from fileio import atomic_write, exits_on_filesystem_errors# standard library only, as this driver must be

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 570  # for `timeout 590`: the steps end by then and the report follows
ENV_LIMIT_S = 45
TEST_LIMIT_S = 120
LOG_LIMIT_BYTES = 15 << 20  # one file back from the machine holds at most 16 MiB
PRINT_LIMIT_CHARS = 11000  # the output's tail that comes back holds 12,000 characters
E2E = ["-m", "bench.e2e", "--preset", "gpt2-124m", "--warmup", "2"]
E2E_ONE_RUN = ["--steps", "200", "--log-every", "20"]  # the one-run steps (E2E_MODES), profiled long after a capture
PROFILE = ["--profile-steps", "186:188"]
CONCURRENT_S = 30  # seconds of training each run of a concurrency step is given, at one run's speed
STEPS = {  # name: cap in seconds (cold compiles on a bare machine, estimated), in the order they run
    "attention": 100, "e2e_kernels": 120, "e2e_graph": 100, "concurrent_2": 90, "concurrent_3": 100,
    "cuda_tests": 570,
}
LEFT_OUT = ["the end-to-end run with SDPA attention", "the attention shape 16x12x1024x64",
            "the optimizer steps against the memory floor (bench.optim)", "the 64 x 512 tokens-per-step run"]
FIRST_TESTS = ["tests/test_step_capture.py", "tests/test_ecd_kernels.py"]  # the CUDA graph's and fused ECD's first
TABLE = Path("kernels/attention_table.json")


class SessionStopped(Exception):
    """SIGTERM reached the driver."""


def read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def commit() -> str:
    """$SYMGPT_COMMIT, else the file SYMGPT_COMMIT beside the code, else git's HEAD (the tree may travel without
    .git)."""
    if os.environ.get("SYMGPT_COMMIT"):
        return os.environ["SYMGPT_COMMIT"].strip()
    if (REPO / "SYMGPT_COMMIT").is_file():
        return (REPO / "SYMGPT_COMMIT").read_text().strip()
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if head.returncode == 0:
            return head.stdout.strip() + (" (modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown (set SYMGPT_COMMIT)"


class Session:
    """The steps' runner and the report's state."""

    def __init__(self, out: Path, budget_s: float, test_limit_s: float) -> None:
        self.out, self.budget_s, self.test_limit_s = out, budget_s, test_limit_s
        self.start = time.monotonic()
        self.work = Path(tempfile.mkdtemp(prefix="gpu_session_"))  # step outputs read into the report
        self.log_path = out / "session.log"
        self.log_path.write_text("")
        self.python: str | None = None
        self.report: dict = {"commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M"), "budget_s": budget_s,
                             "stopped": None, "env": None, "steps": {}, "left_out": LEFT_OUT, "attention": None,
                             "table": None, "e2e": {}, "profiles": {}, "concurrent": {}, "tests": {}}

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.start:5.0f} s] {text}", flush=True)

    # -- running one process --------------------------------------------------------------------------------------

    def run(self, title: str, argv: list[str] | list[list[str]], limit_s: float, env: dict | None = None,
            watch: Callable[[], str | None] = lambda: None) -> str:
        """Run argv (or several argv at once, side by side) each in its own process group with its output appended to
        session.log; the status: "ok", "failed (exit N)", "timed out after N s", or what `watch` (polled) returned
        when it asked to stop."""
        argvs = argv if argv and isinstance(argv[0], list) else [argv]
        with open(self.log_path, "a") as log:
            log.writelines(f"\n===== {title} (limit {limit_s:.0f} s): {' '.join(a)}\n" for a in argvs)
        start = time.monotonic()
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.log_path, "ab") as log:
            procs = [subprocess.Popen(a, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, env=environment) for a in argvs]
        try:
            while True:
                codes = [proc.poll() for proc in procs]
                if all(code is not None for code in codes):
                    failed = [str(code) for code in codes if code]
                    return f"failed (exit {', '.join(failed)})" if failed else "ok"
                reason = watch()
                if reason:
                    return reason
                if time.monotonic() - start >= limit_s:
                    return f"timed out after {limit_s:.0f} s"
                time.sleep(0.2)
        finally:
            for proc in procs:
                _stop(proc)

    def step(self, name: str, argv: list[str] | list[list[str]], cap_s: float) -> None:
        """Run one step under min(cap, what is left); record and print its status."""
        limit = min(cap_s, self.remaining() - 2)
        if limit < 5:
            self.report["steps"][name] = {"status": "not run: no time left in the budget", "limit_s": cap_s}
            self.say(f"{name}: not run, no time left")
            return
        start = time.monotonic()
        self.report["steps"][name] = {"status": "running", "limit_s": round(limit)}
        status = self.run(name, argv, limit)
        self.report["steps"][name] = {"status": status, "seconds": round(time.monotonic() - start, 1),
                                      "limit_s": round(limit)}
        self.say(f"{name}: {status} ({self.report['steps'][name]['seconds']} s)")

    # -- the steps ----------------------------------------------------------------------------------------------

    def find_python(self, given: str | None) -> bool:
        """The environment check with `given`, else with each of python3, python until one passes."""
        names = [given] if given else ["python3", "python"]
        found = (shutil.which(n) or (n if os.path.exists(n) else None) for n in names)
        candidates = list(dict.fromkeys(os.path.abspath(p) for p in found if p))
        if not candidates:
            return self.stop(f"no interpreter found: {', '.join(names)} (set PYTHON=/path/to/python3)")
        start, problems = time.monotonic(), []
        for python in candidates:
            left = ENV_LIMIT_S - (time.monotonic() - start)
            path = self.work / "env.json"
            path.unlink(missing_ok=True)
            status = self.run(f"env {python}", [python, "-m", "bench.session_env", "--out", str(path)],
                              max(left, 1))
            env = read_json(path)
            if status == "ok" and isinstance(env, dict):
                self.python, self.report["env"] = python, env
                self.report["steps"]["env"] = {"status": "ok", "seconds": round(time.monotonic() - start, 1)}
                self.say(f"env: {env.get('gpu')} | torch {env.get('torch')} | Triton {env.get('triton')} | "
                         f"{python}")
                return True
            problem = env.get("problem") if isinstance(env, dict) else None
            problems.append(f"{python}: {problem or status}")
            self.report["env"] = env if isinstance(env, dict) else self.report["env"]
        self.report["steps"]["env"] = {"status": "failed", "seconds": round(time.monotonic() - start, 1)}
        return self.stop("environment check failed: " + "; ".join(problems))

    def stop(self, reason: str) -> bool:
        self.report["stopped"] = reason
        self.say(f"stopped: {reason}")
        return False

    def attention(self) -> None:
        """The paper's attention shape, this GPU's table row written into a copy of the table."""
        path, table = self.work / "attention.json", self.work / "attention_table.json"
        before = (REPO / TABLE).read_text()
        table.write_text(before)
        self.step("attention", [self.python, "-m", "bench.attention", "--shapes", "8x12x512x64", "--warmup-ms", "25",
                                "--rep-ms", "100", "--out", str(path), "--write-table", "--table", str(table)],
                  STEPS["attention"])
        self.report["attention"] = read_json(path)
        self.report["table"] = {"before": before, "after": table.read_text()}

    def attention_flags(self) -> list[str]:
        """The path the attention step chose for sampled biases (what auto takes once its row is committed)."""
        shapes = (self.report["attention"] or {}).get("shapes") or [None]
        choice = ((shapes[0] or {}).get("auto") or {}).get("+bias")
        return ["--attention-impl", choice] if choice else []

    def e2e(self, name: str) -> None:
        path = self.work / f"{name}.json"
        self.step(name, [self.python, *E2E, *E2E_ONE_RUN, "--out", str(path), "--", "--compile-mode",
                         E2E_MODES[name], *PROFILE, *self.attention_flags()], STEPS[name])
        result = read_json(path)
        self.report["e2e"][name] = result
        if isinstance(result, dict) and result.get("profile"):
            self.report["profiles"][name] = result["profile"]

    def concurrent(self, n: int) -> None:
        """n paper-batch runs at once in the faster compile mode, each long enough to train CONCURRENT_S seconds at
        one run's speed; the GPU's tokens/s over the seconds they all trained."""
        mode = faster_mode(self.report["e2e"])
        alone = self.report["e2e"].get("e2e_graph" if mode == "reduce-overhead" else "e2e_kernels")
        step_ms = alone["step_time_ms"] if isinstance(alone, dict) else 20.0
        steps = min(max(round(CONCURRENT_S * 1e3 / (step_ms * n)), 200), 20000)
        paths = [self.work / f"concurrent_{n}_{i}.json" for i in range(n)]
        argvs = [[self.python, *E2E, "--steps", str(steps), "--log-every", str(max(steps // 40, 5)), "--out",
                  str(path), "--", "--compile-mode", mode, "--seed", str(i), *self.attention_flags()]
                 for i, path in enumerate(paths)]
        name = f"concurrent_{n}"
        self.step(name, argvs, STEPS[name])
        results = [read_json(path) for path in paths]
        shared = {"mode": mode, "steps": steps, "runs": results,
                  "alone_tokens_per_s": alone["tokens_per_s"] if isinstance(alone, dict) else None}
        if all(isinstance(r, dict) for r in results):
            overlap = concurrent_tokens_per_s([r["records"] for r in results])
            if overlap:
                shared["tokens_per_s"], shared["overlap_s"] = overlap
            else:
                shared["note"] = "the runs did not train side by side long enough to measure"
        self.report["concurrent"][str(n)] = shared

    def cuda_tests(self) -> None:
        """pytest -m cuda with bench.session_tests reporting each test; a test past --test-limit is stopped and the
        rest run in a new pytest."""
        tests, events = self.report["tests"], self.work / "events.txt"
        targets, start, rounds, first_limit = [*FIRST_TESTS, "tests/"], time.monotonic(), 0, 0
        while True:
            limit = self.remaining() - 2
            if limit < 5:
                break
            first_limit = first_limit or round(limit)
            events.write_text("")
            running: dict = {}

            def watch() -> str | None:
                for line in events.read_text().splitlines()[running.get("lines", 0):]:
                    running["lines"] = running.get("lines", 0) + 1
                    kind, _, rest = line.partition(" ")
                    if kind == "collected":
                        tests.setdefault(rest, {"verdict": "not run"})
                    elif kind == "start":
                        running.update(test=rest, since=time.monotonic())
                        tests[rest] = {"verdict": "running"}
                    else:
                        nodeid, _, seconds = rest.rpartition(" ")
                        tests[nodeid] = {"verdict": kind, "seconds": float(seconds)}
                        running.pop("test", None)
                test = running.get("test")
                if test and time.monotonic() - running["since"] > self.test_limit_s:
                    tests[test] = {"verdict": f"timed out after {self.test_limit_s:.0f} s",
                                   "seconds": round(time.monotonic() - running.pop("since"), 1)}
                    del running["test"]
                    return f"stopped {test}"
                return None

            rounds += 1
            status = self.run(f"cuda_tests round {rounds}",
                              [self.python, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider", "-p",
                               "bench.session_tests", "-m", "cuda", *targets], limit,
                              env={"SYMGPT_SESSION_EVENTS": str(events)}, watch=watch)
            watch()  # the last lines
            if running.get("test"):  # cut by the budget while it ran, or pytest died under it
                verdict = ("timed out: no time left in the budget" if status.startswith("timed out") else
                           f"did not finish: pytest {status}")
                tests[running["test"]] = {"verdict": verdict,
                                          "seconds": round(time.monotonic() - running["since"], 1)}
            left = [t for t, r in tests.items() if r["verdict"] == "not run"]
            if not status.startswith("stopped") or not left:
                break
            targets = left
        if not tests:
            tests["(collection)"] = {"verdict": status if rounds else "not run: no time left in the budget"}
        counts = collections.Counter(r["verdict"].split(":")[0] for r in tests.values())
        summary = ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
        self.report["steps"]["cuda_tests"] = {"status": summary, "seconds": round(time.monotonic() - start, 1),
                                              "limit_s": first_limit}
        self.say(f"cuda_tests: {summary}")

    # -- the report ---------------------------------------------------------------------------------------------

    def write_report(self) -> str:
        self.report["elapsed_s"] = round(time.monotonic() - self.start, 1)
        atomic_write(self.out / "report.json", json.dumps(self.report, indent=1).encode())
        text = markdown(self.report, REPO)
        atomic_write(self.out / "report.md", text.encode())
        return text

    def finish(self) -> None:
        """The report on disk and, last, on stdout; session.log cut to what comes back; the work files removed."""
        text = self.write_report()
        size = self.log_path.stat().st_size
        if size > LOG_LIMIT_BYTES:  # keep its head and tail
            with open(self.log_path, "rb") as f:
                head = f.read(LOG_LIMIT_BYTES // 2)
                f.seek(size - LOG_LIMIT_BYTES // 2)
                tail = f.read()
            self.log_path.write_bytes(head + f"\n[... {size - LOG_LIMIT_BYTES} bytes cut ...]\n".encode() + tail)
        shutil.rmtree(self.work, ignore_errors=True)
        print("\n" + (text if len(text) <= PRINT_LIMIT_CHARS else markdown(self.report, REPO, compact=True)),
              flush=True)


def _stop(proc: subprocess.Popen) -> None:
    """End a step's whole process group: SIGTERM to a step still running, then, after at most 5 s, SIGKILL to what
    is left in its group."""
    for sig in ((signal.SIGTERM,) if proc.poll() is None else ()) + (signal.SIGKILL,):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(module="bench.gpu_session", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "runs/gpu"),
                        help="directory for report.md, report.json and session.log (default: $OUT, else runs/gpu)")
    parser.add_argument("--python", default=os.environ.get("PYTHON") or None,
                        help="the interpreter for the steps (default: $PYTHON, else the first of python3, python "
                             "whose torch sees CUDA)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for every step (default {BUDGET_S})")
    parser.add_argument("--test-limit", type=float, default=TEST_LIMIT_S,
                        help=f"seconds for one CUDA test (default {TEST_LIMIT_S})")
    parser.add_argument("--only", nargs="+", choices=list(STEPS), default=list(STEPS),
                        help="run only these steps (the environment check always runs)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    session = Session(args.out.resolve(), args.budget, args.test_limit)

    def terminate(signum, frame):
        raise SessionStopped(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, terminate)  # given back at the end: main() may run inside a process
    actions = {"attention": session.attention, "cuda_tests": session.cuda_tests,
               **{name: (lambda name=name: session.e2e(name)) for name in E2E_MODES},
               **{f"concurrent_{n}": (lambda n=n: session.concurrent(n)) for n in (2, 3)}}
    try:
        if session.find_python(args.python):
            session.write_report()
            for name in args.only:
                actions[name]()
                session.write_report()
    except SessionStopped as exc:
        session.stop(f"{exc} reached the session; what was measured until then is below")
        for name, r in session.report["steps"].items():
            if r["status"] == "running":
                r["status"] = f"stopped by {exc}"
    finally:
        signal.signal(signal.SIGTERM, previous)
    session.finish()
    return 1 if session.report["stopped"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
