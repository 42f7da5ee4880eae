"""What several test modules share (fixtures live in conftest.py): the repository's modules, the synthetic corpus and
the tiny trainer runs on it, the tiny GPT and its configuration, a trainer held at a step for a signal and bounded
waits for a subprocess's output, a grid's environment and the runs it started, gloo ranks (forked with the
environment torchrun gives its workers, or under torchrun itself), CUDA's graph API stood in for on the CPU, a fake
Hugging Face Hub, the v1 checkpoint layouts, the published SOAP (a float64 NumPy transcription, a stand-in for its
class), and the TRITON_INTERPRET=1 subprocess runner."""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128  # the synthetic corpus' vocabulary
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # one thread: bit-exact runs on the CPU
GRID_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # `python -m grid`, which gives each worker its share of threads


# Top-level folders whose .py files are not the repository's modules: the tests, build outputs, and the trainer's
# default run directory (each run keeps a copy of the code it ran).
NOT_SOURCE = ("tests", "build", "runs")


def repository_modules() -> list[str]:
    """Every module of the repository, as `import` names it: each .py file at any depth (in a package, a sub-package
    or a folder without __init__.py, which Python imports as a namespace package), leaving out NOT_SOURCE, hidden
    folders (.git, .venv, caches) and __pycache__. The list that the packaging and layer tests check, derived from
    the tree rather than typed."""
    modules = []
    for folder, subfolders, files in os.walk(ROOT):
        where = Path(folder).relative_to(ROOT).parts
        subfolders[:] = sorted(name for name in subfolders if not name.startswith((".", "__"))
                               and (where or name not in NOT_SOURCE))
        modules += [".".join((*where, name.removesuffix(".py"))).removesuffix(".__init__")
                    for name in sorted(files) if name.endswith(".py")]
    return modules


def synthetic_tokens(num_tokens: int, seed: int, vocab: int = VOCAB) -> np.ndarray:
    """A learnable toy language: a Zipf-distributed stream of 40 fixed random 'words' of 2-5 tokens each, with ids in
    [1, vocab)."""
    vocabulary = np.random.default_rng(1234)  # the same words in every shard
    words = [vocabulary.integers(1, vocab, size=vocabulary.integers(2, 6)) for _ in range(40)]
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, 41)
    picks = rng.choice(40, size=num_tokens // 2, p=weights / weights.sum())
    return np.concatenate([words[i] for i in picks])[:num_tokens].astype(np.uint16)


TINY_GPT = dict(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)  # tiny_gpt's model


def tiny_config(**overrides):
    """The tiny GPT's configuration: TINY_GPT, `overrides` changing any GPTConfig field."""
    import train_gpt

    return train_gpt.GPTConfig(**{**TINY_GPT, **overrides})


def tiny_gpt(seed: int = 0, noise: float = 0.0, **overrides):
    """The tests' tiny GPT: tiny_config(**overrides), initialised after torch.manual_seed(seed); noise > 0 then adds
    noise · N(0, 1) to every parameter, so that biases, LayerNorms and slopes are generic rather than at their initial
    values. In training mode, float32; its configuration is `model.config`."""
    import train_gpt

    torch.manual_seed(seed)
    model = train_gpt.GPT(tiny_config(**overrides))
    if noise:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * torch.randn_like(p))
    return model


def tiny_args(corpus: Path, run_dir: Path, name: str, **overrides) -> list[str]:
    """The trainer's flags for a tiny model (2 layers, width 32) on the `corpus` fixture for 8 CPU steps, the run in
    run_dir/name; `overrides` ({"flag-name": value}, booleans as switches) add to or replace them."""
    args = {
        "train-files": str(corpus / "syn_train_*.bin"), "val-files": str(corpus / "syn_val_*.bin"),
        "vocab-size": VOCAB, "block-size": 32, "n-layer": 2, "n-head": 2, "n-embd": 32,
        "seq-len": 32, "micro-batch": 4, "batch-tokens": 256, "steps": 8, "lr": 3e-3,
        "val-every": 4, "val-tokens": 1024, "log-every": 1, "device": "cpu",
        "run-dir": str(run_dir), "run-name": name,
    }
    args.update(overrides)
    return [(f"--{k}" if v else f"--no-{k}") if isinstance(v, bool) else f"--{k}={v}" for k, v in args.items()]


def train_losses(run_dir: Path) -> dict[int, float]:
    """{step: training loss} of a run's log.jsonl."""
    from run.log import read_log

    return {r["step"]: r["train_loss"] for r in read_log(run_dir) if "train_loss" in r}


def resume_in_new_directory(checkpoint: Path, resumed: Path) -> Path:
    """Copy `checkpoint` to resumed/checkpoints/latest.pt and continue it there with `--resume` (no other flag)."""
    import train_gpt

    (resumed / "checkpoints").mkdir(parents=True)
    (resumed / "checkpoints" / "latest.pt").write_bytes(checkpoint.read_bytes())
    train_gpt.main(["--resume", str(resumed)])
    return resumed


def train_tiny_run(root: Path, *flags: str) -> Path:
    """Train a tiny model (2 layers, width 32, vocabulary 64) for 4 CPU steps on a random shard written under `root`
    and return its run directory `root/tiny`; `flags` add to or override the trainer's flags."""
    import train_gpt
    from data.shards import write_shard

    shard = root / "tiny_val_000000.bin"
    write_shard(shard, np.random.default_rng(0).integers(0, 64, 2048))
    train_gpt.main(["--train-files", str(shard), "--val-files", str(shard), "--vocab-size", "64",
                    "--block-size", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "32",
                    "--batch-tokens", "64", "--micro-batch", "2", "--steps", "4", "--val-every", "0",
                    "--val-tokens", "64", "--run-dir", str(root), "--run-name", "tiny", "--device", "cpu",
                    "--no-compile", "--lr", "1e-2", *flags])
    return root / "tiny"


def held_env(step: int, env: dict[str, str] = ENV) -> dict[str, str]:
    """`env` for a trainer subprocess that holds after its `step`-th step until SIGINT or SIGTERM arrives, printing
    `held after step STEP (rank R)` (tests/hold/sitecustomize.py): a test signals it there and knows where it stops."""
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "hold"), env.get("PYTHONPATH", str(ROOT))]),
            "SYMGPT_TEST_HOLD_AFTER_STEP": str(step)}


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 300) -> None:
    """Poll `condition` until it holds; fail naming `what` did not happen if it still does not after `timeout` s
    (a bound for a hang, never a measurement: keep it far above the time the event takes on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: did not happen within {timeout} s"
        time.sleep(0.02)


class PipedLines:
    """A subprocess's piped stdout (text mode), read on a thread into `lines`, so a test can wait for a line with a
    bound (`wait_for`) and read the whole output once the process has ended (`text`)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines = proc, []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, count: int = 1, timeout: float = 300) -> None:
        """Until `text` has appeared `count` times (e.g. once per rank: ranks sharing the pipe may interleave their
        lines, so occurrences are counted, not lines); the failure shows the output so far."""
        try:
            wait_until(lambda: self.text(wait=False).count(text) >= count, f"{count} x {text!r}", timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the output so far:\n{self.text(wait=False)[-3000:]}") from None

    def text(self, wait: bool = True, timeout: float = 300) -> str:
        """The output so far; with wait=True, all of it, once the process has ended (within `timeout` s)."""
        if wait:
            self.proc.wait(timeout=timeout)
            self._reader.join(timeout=timeout)
        return "".join(list(self.lines))


def stop_held_trainer(args: list[str], step: int, signum: int) -> str:
    """Run the trainer with `args` in a subprocess held after `step` (held_env), send it `signum` there, and return
    its output once it has exited, as it must, with 128 + signum."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "train_gpt.py"), *args], env=held_env(step),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = PipedLines(proc)
    output.wait_for(f"held after step {step}")
    proc.send_signal(signum)
    assert proc.wait(timeout=300) == 128 + signum, output.text()
    return output.text()


def started(directory: Path) -> list[str]:
    """The runs the grid in `directory` started (grid.jsonl's `running` records), in order."""
    from grid.execute import Journal

    return [r["run"] for r in Journal(directory).records() if r.get("state") == "running"]


class _Zygote:
    """tests/zygote.py, started once per test process with ENV (so its imports see OMP_NUM_THREADS=1, as a rank
    started with ENV would): each `start` forks a rank from it, skipping the ~2 s of imports a fresh interpreter
    pays."""

    process: subprocess.Popen | None = None

    @classmethod
    def start(cls, script: Path, args: list[str], env: dict[str, str], stdout: Path, stderr: Path) -> ForkedRank:
        if cls.process is None or cls.process.poll() is not None:
            cls.process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py")], cwd=ROOT, env=ENV,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            atexit.register(cls.process.kill)
        status = stdout.with_suffix(".status")
        request = {"script": str(script), "args": args, "env": env, "cwd": os.getcwd(), "stdout": str(stdout),
                   "stderr": str(stderr), "status": str(status)}
        cls.process.stdin.write(json.dumps(request) + "\n")
        cls.process.stdin.flush()
        return ForkedRank(int(cls.process.stdout.readline()), status)


class ForkedRank:
    """A rank forked by the zygote, with the part of Popen's interface that `ranks` uses. Its exit status comes from
    the file it writes as it ends; a rank that ended without writing it was killed (-SIGKILL)."""

    def __init__(self, pid: int, status: Path):
        self.pid, self.status, self.returncode = pid, status, None

    def poll(self) -> int | None:
        if self.returncode is None:
            written = self.status.read_text() if self.status.exists() else ""
            if written:
                self.returncode = int(written)
            else:
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:  # reaped by the zygote without a status: killed
                    self.returncode = -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        wait_until(lambda: self.poll() is not None, f"rank pid {self.pid} to end")
        return self.returncode


def ranks(args: list[str], nproc: int = 2, script: Path = ROOT / "train_gpt.py", timeout: float = 300,
          grace: float = 30) -> subprocess.CompletedProcess:
    """`script` (the trainer) on `nproc` gloo ranks started as torchrun starts its workers, without torchrun's own
    interpreter: each rank a process with RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE and the address of a
    store this process hosts, as torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE: no port is chosen and left
    free for another process to take). Each rank is `python script args` forked from a process that has already
    imported the trainer (tests/zygote.py), not a fresh interpreter: the imports are the same for every rank, and
    they are paid once per test process instead of once per rank (about 2 s of CPU each). For what ranks do; what
    the launcher itself does (passing a signal on) is tested under torchrun (torchrun_in_background). Once a rank
    fails, the others have `grace` seconds to end on their own, as under torchrun, and are then killed (so are all
    after `timeout` s). Returns the ranks' output (each rank's in turn) and the exit code of the first rank that
    failed (0 when none did)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    common = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with tempfile.TemporaryDirectory() as logs:
        outputs = [(Path(logs) / f"{rank}.out", Path(logs) / f"{rank}.err") for rank in range(nproc)]
        procs = [_Zygote.start(Path(script), args, {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}, out, err)
                 for rank, (out, err) in enumerate(outputs)]
        deadline, failures = time.monotonic() + timeout, []
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if not failures and (failures := [p.returncode for p in procs if p.poll()]):
                    deadline = min(deadline, time.monotonic() + grace)
                time.sleep(0.02)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        failures = failures or [p.returncode for p in procs if p.returncode]
        return subprocess.CompletedProcess(args, failures[0] if failures else 0,
                                           "".join(out.read_text() for out, _ in outputs),
                                           "".join(err.read_text() for _, err in outputs))


def torchrun_in_background(args: list[str], nproc: int = 2, env: dict[str, str] = ENV) -> subprocess.Popen:
    """The trainer under torchrun in a session of its own (so a test can signal the whole job), output piped."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                             str(ROOT / "train_gpt.py"), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


# Research fields that the oldest v1 layout kept in the train section (it had no research section).
V1_RESEARCH_IN_TRAIN = ("dynamics_every", "gauge", "gauge_correction", "gauge_every", "gauge_damping",
                        "gauge_group", "hyperball_lr", "gauge_diagnostic_every")


class FakeCuda:
    """torch.cuda's stream and graph API as StepGraph uses it, on the CPU, for a step function wrapped by `recording`:
    a capture runs the function once (the work that the replay following a capture does on CUDA, which here then runs
    nothing); a later replay runs it again on the captured inputs, writes its outputs into the captured ones and, as a
    replay runs no Python, puts back every attribute of the `frozen` objects that the run rebound (not what it
    changed in place inside them). `fail` makes the capture end with CUDA's error."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.events, self.capturing = fail, [], None
        self.frozen: list[object] = []

    def recording(self, fn):
        """`fn` as StepGraph's step: called while capturing, it records itself, its inputs and its outputs."""
        def step(*inputs):
            outputs = fn(*inputs)
            if self.capturing is not None:
                self.capturing.fn, self.capturing.args, self.capturing.outputs = fn, inputs, outputs
            return outputs
        return step

    def install(self, monkeypatch) -> None:
        from run.capture import tensors

        class Graph:
            def __init__(graph):
                graph.ran = True  # by the capture, until its first replay

            def replay(graph):
                self.events.append("replay")
                if graph.ran:
                    graph.ran = False
                    return
                kept = [(obj, dict(vars(obj))) for obj in self.frozen]
                outputs = graph.fn(*graph.args)
                for obj, attributes in kept:
                    vars(obj).clear()
                    vars(obj).update(attributes)
                for captured, value in zip(tensors(graph.outputs), tensors(outputs), strict=True):
                    captured.copy_(value)

        class Capture:
            def __init__(capture, graph, capture_error_mode):
                capture.graph = graph

            def __enter__(capture):
                self.events.append("capture")
                self.capturing = capture.graph

            def __exit__(capture, *exc):
                self.capturing = None
                if self.fail:
                    raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

        class Stream:
            def __init__(stream, device=None):
                pass

            def wait_stream(stream, other):
                pass

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", Capture)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())


HUB_REPO = "someone/fake-shards"  # the dataset FakeHub serves
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Serves `files` at the Hub's resolve URLs (HEAD + GET with Range) and its tree listing, with scripted faults.

    truncate: names whose next GET sends half the body and drops the connection (once each).
    fail: names whose next GET answers 500 (once each).
    corrupt: name -> how many GETs serve the tokens reversed (valid header and ids: only the sha256 can tell).
    """

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.gets: Counter[str] = Counter()
        self.truncate: set[str] = set()
        self.fail: set[str] = set()
        self.corrupt: Counter[str] = Counter()
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _name(self) -> str | None:
                prefix = f"/datasets/{HUB_REPO}/resolve/main/"
                name = self.path.split("?")[0][len(prefix):] if self.path.startswith(prefix) else None
                return name if name in hub.files else None

            def _headers(self, name: str, status: int, length: int, extra: dict | None = None) -> None:
                self.send_response(status)
                self.send_header("X-Repo-Commit", HUB_COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(hub.files[name]).hexdigest()}"')
                self.send_header("Content-Length", str(length))
                self.send_header("Accept-Ranges", "bytes")
                for key, value in (extra or {}).items():
                    self.send_header(key, value)
                self.end_headers()

            def do_HEAD(self):
                name = self._name()
                if name is None:
                    self.send_error(404)
                    return
                self._headers(name, 200, len(hub.files[name]))

            def do_GET(self):
                if self.path.startswith(f"/api/datasets/{HUB_REPO}/tree/main"):
                    listing = json.dumps([{"type": "file", "path": n, "size": len(b),
                                           "oid": hashlib.sha1(b).hexdigest()} for n, b in hub.files.items()]).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(listing)))
                    self.end_headers()
                    self.wfile.write(listing)
                    return
                name = self._name()
                if name is None:
                    self.send_error(404)
                    return
                hub.gets[name] += 1
                if name in hub.fail:
                    hub.fail.discard(name)
                    self.send_error(500)
                    return
                body = hub.files[name]
                if hub.corrupt[name] > 0:
                    hub.corrupt[name] -= 1
                    body = body[:1024] + np.frombuffer(body[1024:], dtype="<u2")[::-1].tobytes()
                start = 0
                if "Range" in self.headers:
                    start = int(self.headers["Range"].split("=")[1].split("-")[0])
                    self._headers(name, 206, len(body) - start,
                                  {"Content-Range": f"bytes {start}-{len(body) - 1}/{len(body)}"})
                else:
                    self._headers(name, 200, len(body))
                if name in hub.truncate:
                    hub.truncate.discard(name)
                    self.wfile.write(body[start:len(body) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(body[start:])

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def write_v1_checkpoint(source: Path, target: Path, oldest: bool = False) -> None:
    """Rewrite the checkpoint `source` (written by today's trainer) in a layout of the first format, v1, at `target`.
    The newest v1 layout: the optimizer state in a one-element "optimizers" list, with a checksum. The oldest
    (oldest=True): also no checksum, both names of the tied embedding stored and no "tied" entry, the sampler
    entry and the gauge's state as "gauge" (no "hooks"), and a config without "preset", "data" or a research
    section (its fields in train, --gauge-project-velocity unknown), --keep-checkpoints as a switch and
    --decay-groups as its two switches. Written by hand, as the old trainer wrote them, independently of
    run.checkpoint.upgrade."""
    from run.checkpoint import tensor_checksum

    ckpt = torch.load(source, map_location="cpu", weights_only=False)
    ckpt["format"] = "symgpt-checkpoint-v1"
    del ckpt["kind"], ckpt["config"]["attention"]  # v3's
    ckpt["optimizers"] = [ckpt.pop("optimizer")]
    if oldest:
        for alias, name in ckpt.pop("tied").items():
            ckpt["model"][alias] = ckpt["model"][name].clone()
        ckpt.pop("checksum")
        hooks = ckpt.pop("hooks")
        if "gauge" in hooks:
            ckpt["gauge"] = hooks["gauge"]
        ckpt["sampler"] = {"seed": ckpt["config"]["train"]["seed"], "rule": "SeedSequence([seed, step, layer])"}
        config = ckpt["config"]
        research = config.pop("research")
        assert research["gauge"] != "project" or not research["gauge_project_velocity"], "v1 projected the step only"
        config.pop("preset"), config.pop("data")
        config["train"].update({k: research[k] for k in V1_RESEARCH_IN_TRAIN})
        config["train"]["keep_checkpoints"] = config["train"]["keep_checkpoints"] != 0
        groups = config["optim"].pop("decay_groups")
        config["optim"]["decay_embeddings"] = groups in ("matrices+embeddings", "all")
        config["optim"]["decay_norms_and_biases"] = groups in ("all-but-embeddings", "all")
    else:
        ckpt["checksum"] = tensor_checksum(ckpt)
    torch.save(ckpt, target)


def relative_difference(a: dict, b: dict) -> float:
    """|a − b| / |b| over all tensors together."""
    diff = torch.cat([(a[k] - b[k]).flatten() for k in a])
    return (diff.norm() / torch.cat([b[k].flatten() for k in a]).norm()).item()


# A stand-in with the published SOAP class's interface (plain Adam, state in lists as the published SOAP keeps its
# factors): the repository carries no peer code.
PUBLISHED_SOAP = textwrap.dedent('''
    import torch

    class SOAP(torch.optim.Adam):
        def __init__(self, params, lr, betas, eps, weight_decay, precondition_frequency, max_precond_dim):
            super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

        def step(self):
            super().step()
            for p, state in self.state.items():
                state.setdefault("GG", [torch.zeros_like(p), []])
''')


def np_project(x, bases):
    for q in bases:
        x = np.tensordot(x, q, axes=([0], [0])) if q is not None else np.moveaxis(x, 0, -1)
    return x


def np_project_back(x, bases):
    for q in bases:
        x = np.tensordot(x, q, axes=([0], [1])) if q is not None else np.moveaxis(x, 0, -1)
    return x


def published_eigenbasis(factor):
    """The published first basis: eigh's eigenvectors by descending eigenvalue."""
    return np.flip(np.linalg.eigh(factor)[1], 1)


def reference_soap(params, grad_fn, steps, lr, betas, eps, wds, freq, max_dim, merge, pre1d, shampoo_beta,
                   eigenbasis=published_eigenbasis):
    """The published SOAP step (per tensor, m projected back and forth every step) in float64 NumPy; `eigenbasis`
    takes the first bases from the first factors."""
    from optim.soap import merged_shape

    b1, b2 = betas
    bs = b2 if shampoo_beta is None else shampoo_beta
    states = [{} for _ in params]
    for call in range(steps):
        grads = grad_fn(params, call)
        for p, g, st, wd in zip(params, grads, states, wds):
            shape = merged_shape(p.shape, max_dim) if merge and p.ndim > 1 else p.shape
            g = g.reshape(shape)
            if "Q" not in st:
                rot = [pre1d and p.size <= max_dim] if p.ndim == 1 else [s <= max_dim for s in shape]
                st.update(step=0, m=np.zeros(shape), v=np.zeros(shape), Q=None,
                          GG=[np.zeros((s, s)) if r else None for s, r in zip(shape, rot)])
            else:
                gp = np_project(g, st["Q"])
                st["step"] += 1
                t = st["step"]
                st["m"] = b1 * st["m"] + (1 - b1) * gp
                st["v"] = b2 * st["v"] + (1 - b2) * gp**2
                n = np_project_back(st["m"] / (np.sqrt(st["v"]) + eps), st["Q"]).reshape(p.shape)
                p -= lr * np.sqrt(1 - b2**t) / (1 - b1**t) * n
                if wd > 0:
                    p -= lr * wd * p
                st["m"] = np_project_back(st["m"], st["Q"])
            for d, f in enumerate(st["GG"]):
                if f is not None:
                    others = [k for k in range(g.ndim) if k != d]
                    st["GG"][d] = bs * f + (1 - bs) * np.tensordot(g, g, axes=(others, others))
            if st["Q"] is None:
                st["Q"] = [eigenbasis(f) if f is not None else None for f in st["GG"]]
            elif st["step"] % freq == 0:
                for d, (f, q) in enumerate(zip(st["GG"], st["Q"])):
                    if f is not None:
                        order = np.argsort(-np.diag(q.T @ f @ q), kind="stable")
                        st["v"] = np.take(st["v"], order, axis=d)
                        st["Q"][d] = np.linalg.qr(f @ q[:, order])[0]
            if st["step"] > 0:
                st["m"] = np_project(st["m"], st["Q"])
    return params


def patch_triton_interpreter() -> None:
    """For a TRITON_INTERPRET=1 process: Triton <= 3.6's interpreter converts (1,)-shaped scalars with int(), an
    error since NumPy 2.4 (triton-lang/triton#9171, fixed upstream by #9172); apply the upstream fix."""
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def run_in_interpreter(test_file: str, out_dir: Path, timeout: int) -> dict:
    """Run `python test_file RESULT.json` with TRITON_INTERPRET=1 (kernels on the CPU; the variable must not leak
    into other tests, so it gets its own process) and return the JSON it writes."""
    path = out_dir / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, test_file, str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0 and path.exists(), f"interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(path.read_text())


def interpreter_results(test_file: str, tmp_path_factory, timeout: int = 900) -> dict:
    """`run_in_interpreter` for a test module's fixture: its JSON, failing with the subprocess's traceback if any."""
    data = run_in_interpreter(test_file, tmp_path_factory.mktemp(Path(test_file).stem), timeout=timeout)
    assert "traceback" not in data, data["traceback"]
    return data


def write_interpreter_results(path: str, **checks) -> None:
    """The TRITON_INTERPRET=1 subprocess's side: run each check (a function returning a JSON-able dict) and write
    {name: result}, or {"traceback": ...} if one raises. One torch thread: the checks' products are tiny, and with
    several threads each waits for cores the interpreter keeps busy."""
    import traceback

    patch_triton_interpreter()
    torch.set_num_threads(1)
    try:
        results = {name: check() for name, check in checks.items()}
    except Exception:
        results = {"traceback": traceback.format_exc()}
    Path(path).write_text(json.dumps(results))


# -- the paper's runs as a finished run leaves them (the scorecard's and the published data's tests) ---------------

PROTOCOL = ("--val-biases", "last-sample")  # the published trainer's validation


def data_record(kind: str) -> dict:
    """What config.json records of FineWeb-Edu shards (`fineweb`, or `fineweb-copy`: the same names, other
    contents; 800M training tokens, as `python -m data.fineweb_edu --chunks 8` downloads) or of the embedded
    corpus."""
    prefix = {"fineweb": "finewebedu", "fineweb-copy": "finewebedu", "embedded": "embedded"}[kind]
    files = {"train": range(1, 9), "val": (0,)}
    split = {name: {"given": "", "pattern": f"/data/{prefix}_{name}_*.bin", "tokens": 100_000_000 * len(files[name]),
                    "files": [{"path": f"/data/{prefix}_{name}_00000{i}.bin", "tokens": 100_000_000,
                               "sha256": kind[0] * 64} for i in files[name]]}
             for name in ("train", "val")}
    return {**split, "fingerprint": {"fineweb": "f" * 16, "fineweb-copy": "c" * 16, "embedded": "e" * 16}[kind]}


def finished_run(root: Path, name: str, optimizer: str, bias: str, seed: int, best: float | None, *,
                 mean_v: float | None = None, gelu: bool = False, data: str = "fineweb", flags: tuple = PROTOCOL,
                 finished: bool = True, logic: dict | None = None, log: list[dict] | None = None) -> Path:
    """A run directory as a finished paper run leaves it: config.json of the paper's preset with these settings,
    log.jsonl whose best single-batch validation estimate is `best` (or `log` as given), and the paper suite's logic
    numbers."""
    argv = ["--preset", "gpt2-124m-gelu" if gelu else "gpt2-124m", "--optimizer", optimizer, "--bias-mode", bias,
            "--seed", str(seed), *(["--mean-v", str(mean_v)] if mean_v is not None else []), *flags]
    import train_gpt

    config = train_gpt.parse_config(argv)
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({**config.to_dict(), "data": data_record(data)}))
    steps = config.train.steps
    records = [{"step": 1000, "tokens": 4096000, "val_loss_batch": best, "best_val_loss_batch": best}]
    records += [{"summary": True, "step": steps, "best_val_loss_batch": best}] if finished else []
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (log or records)))
    if logic is not None:
        (run / "eval").mkdir()
        (run / "eval" / "logic_puzzles.json").write_text(json.dumps(
            {"suites": [{"name": "paper", "protocol": "paper", "overall": logic}]}))
    return run
