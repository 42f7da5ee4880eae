"""One run over several nodes without a scheduler: two torchrun agents (--nnodes=2 --nproc_per_node=1) that meet at a
c10d rendezvous on 127.0.0.1, as the agents of two nodes do, each starting one gloo rank. Both ranks are local rank 0
of their node, so data and validation split by the local rank would give both ranks the same rows: the losses
match one process only when they are split by the global rank. Only global rank 0 writes the run directory (the
nodes share it), and a run stopped on two nodes resumes on one as a run resumes on another number of ranks.
slurm/multinode.sbatch, which starts these agents under Slurm, is tested in test_slurm.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import train_gpt
from run.checkpoint import load_checkpoint
from run.log import read_log
from tests.helpers import ENV, ROOT, PipedLines, held_env, tiny_args, train_losses
from tests.slurm_cluster import free_port

pytestmark = pytest.mark.serial


def agents(args: list[str], env: dict[str, str] = ENV, nodes: int = 2) -> list[tuple[subprocess.Popen, PipedLines]]:
    """The trainer under `nodes` torchrun agents of one rank each, meeting at a c10d rendezvous on this machine;
    each agent in a session of its own (as on its own node), its output piped."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
                               "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
                               "--rdzv_id=multinode", str(ROOT / "train_gpt.py"), *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for _ in range(nodes)]
    return [(proc, PipedLines(proc)) for proc in procs]


def test_two_nodes_train_the_losses_of_one_process_and_only_global_rank_0_writes(corpus, tmp_path, one_thread):
    train_gpt.main(tiny_args(corpus, tmp_path, "one"))
    started = agents(tiny_args(corpus, tmp_path, "two"))
    outputs = [lines.text() for _, lines in started]
    assert [proc.returncode for proc, _ in started] == [0, 0], outputs
    single, double = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(double) == list(range(1, 9))
    for step in single:
        assert double[step] == pytest.approx(single[step], rel=1e-5, abs=1e-6)
    vals = [[r["val_loss"] for r in read_log(tmp_path / name) if "val_loss" in r] for name in ("one", "two")]
    assert vals[0] and vals[1] == pytest.approx(vals[0], rel=1e-5)
    log = (tmp_path / "two" / "log.txt").read_text()
    assert "| world 2" in log and "2 ranks x 1 micro-steps x 4 sequences" in log
    assert sum(line.startswith("step 8/8 | loss") for line in log.splitlines()) == 1  # one writer
    assert sorted(os.listdir(tmp_path)) == ["one", "two"]
    assert sum("done: 8 steps" in text for text in outputs) == 1  # global rank 0's agent prints the run's lines


def test_a_run_stopped_on_two_nodes_resumes_on_one(corpus, tmp_path, one_thread):
    """SIGTERM to every node's agent (as a scheduler's cancellation sends it) while both ranks hold after step 3:
    they agree to stop at step 4 with one checkpoint, and one process continues it with the losses of a run
    that never stopped."""
    common = {"val-every": 0}
    started = agents(tiny_args(corpus, tmp_path, "moved", **common), env=held_env(3))
    for _, lines in started:
        lines.wait_for("held after step 3")
    for proc, _ in started:
        os.killpg(proc.pid, signal.SIGTERM)
    outputs = [lines.text() for _, lines in started]
    assert load_checkpoint(tmp_path / "moved" / "checkpoints" / "latest.pt")["step"] == 4, outputs
    train_gpt.main(["--resume", str(tmp_path / "moved")])
    train_gpt.main(tiny_args(corpus, tmp_path, "single", **common))
    single, moved = train_losses(tmp_path / "single"), train_losses(tmp_path / "moved")
    assert sorted(moved) == list(range(1, 9)) and "| world 1" in (tmp_path / "moved" / "log.txt").read_text()
    for step in single:
        assert moved[step] == pytest.approx(single[step], rel=1e-5, abs=1e-6)
