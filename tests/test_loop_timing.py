"""The training loop's timing (timing.py, docs/runs.md#timing): a log step's line is written after the next step is
issued (no wait for the device between log steps), ms per step, the bias draws a block ahead, --compile-mode in
config.json and passed to torch.compile, and --profile-steps' trace and summary."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import train_gpt
from run import capture
from run.log import RunLog, read_log
from run.process import setup_process
from tests.helpers import tiny_args


def test_a_log_line_is_written_after_the_next_step_is_issued(corpus, tmp_path, monkeypatch):
    """The line of log step N waits for step N+1 to be issued (by then the device has finished step N), except the
    last, written when the loop ends; the numbers are those the step computed."""
    events: list[str] = []
    train_step, write_line = train_gpt.Trainer.train_step, RunLog.line

    def recording_step(self):
        loss, grad_norm = train_step(self)
        events.append(f"issued {self.progress.step} loss {loss.item():.6f}")
        return loss, grad_norm

    def recording_line(self, text):
        if text.startswith("step ") and "| loss " in text:
            events.append(f"logged {text.split()[1].split('/')[0]} loss {text.split('| loss ')[1].split()[0]}")
        write_line(self, text)

    monkeypatch.setattr(train_gpt.Trainer, "train_step", recording_step)
    monkeypatch.setattr(RunLog, "line", recording_line)
    train_gpt.main(tiny_args(corpus, tmp_path, "order", steps=6, **{"log-every": 2, "val-every": 0}))
    logged = [i for i, e in enumerate(events) if e.startswith("logged")]
    assert [events[i].split()[1] for i in logged] == ["2", "4", "6"]
    assert events[logged[0] - 1].startswith("issued 3") and events[logged[1] - 1].startswith("issued 5")
    assert events[logged[2] - 1].startswith("issued 6")  # the last: when the loop ends
    issued = {e.split()[1]: float(e.split()[3]) for e in events if e.startswith("issued")}
    for i in logged:
        step, loss = events[i].split()[1], float(events[i].split()[3])
        assert loss == pytest.approx(issued[step], abs=1e-4)


def test_the_log_shows_ms_per_step_of_the_training_clock(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "ms", steps=6, **{"log-every": 3, "val-every": 3}))
    records = [r for r in read_log(tmp_path / "ms") if "train_loss" in r]
    assert [r["step"] for r in records] == [3, 6]
    for before, r in zip([{"step": 0, "train_time_s": 0.0}] + records, records):
        seconds = r["train_time_s"] - before["train_time_s"]
        assert r["step_ms"] == pytest.approx(1e3 * seconds / (r["step"] - before["step"]))
        assert r["tokens_per_s"] == pytest.approx(3 * 256 / seconds)
    text = (tmp_path / "ms" / "log.txt").read_text()
    assert f"{records[1]['step_ms']:.2f} ms/step" in text
    val = [r for r in read_log(tmp_path / "ms") if "val_loss" in r and "train_loss" not in r]
    assert val[-1]["train_time_s"] >= records[-1]["train_time_s"]  # the clock never runs backwards


@pytest.mark.parametrize("per_head", [False, True])
def test_drawing_steps_ahead_gives_the_same_biases_in_any_order(per_head):
    cfg = train_gpt.GPTConfig(n_layer=3, n_head=2, n_embd=16, bias_per_head=per_head)
    one, ahead = train_gpt.BiasSampler(cfg, seed=5), train_gpt.BiasSampler(cfg, seed=5, ahead=4)
    for step in [0, 1, 2, 3, 4, 9, 7, 8, 100, 2]:  # within a block, across blocks, backwards (a resume)
        assert torch.equal(ahead.sample(step), one.sample(step)), step
    assert ahead._drawn[0] == 2 and ahead._drawn[1].shape[0] == 4  # one draw of four steps at a time


def test_compile_mode_is_recorded_and_passed_to_torch_compile(corpus, tmp_path, monkeypatch):
    train_gpt.main(tiny_args(corpus, tmp_path, "mode", steps=1, **{"compile-mode": "reduce-overhead"}))
    assert json.loads((tmp_path / "mode" / "config.json").read_text())["train"]["compile_mode"] == "reduce-overhead"
    cfg = train_gpt.parse_config(tiny_args(corpus, tmp_path, "modes", **{"compile-mode": "max-autotune"}))
    rt = setup_process(cfg.train)
    trainer = train_gpt.Trainer(cfg, rt, RunLog(True))
    try:
        calls = []
        monkeypatch.setattr(torch, "compile", lambda model, **kwargs: calls.append(kwargs) or model)
        trainer.rt = dataclasses.replace(rt, device=torch.device("cuda"))  # it compiles on CUDA only
        _, _, run_step = trainer.build_step()
        # torch.compile tunes its kernels without CUDA graphs of its own: the trainer replays the whole step
        assert calls == [{"mode": "max-autotune-no-cudagraphs"}] and isinstance(run_step, capture.StepGraph)
    finally:
        trainer.close()


def test_bad_compile_mode_and_profile_window_are_refused(capsys):
    for argv, message in [(["--compile-mode", "fast"], "invalid choice: 'fast'"),
                          (["--profile-steps", "5"], "--profile-steps '5': write A:B"),
                          (["--profile-steps", "4:2"], "--profile-steps '4:2': needs 0 <= A < B")]:
        with pytest.raises(SystemExit) as excinfo:
            train_gpt.parse_config(["--device", "cpu", *argv])
        assert excinfo.value.code == 2 and message in capsys.readouterr().err


def test_profile_steps_writes_a_trace_and_summarises_host_time(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "prof", steps=6, **{"profile-steps": "2:4", "val-every": 0}))
    run = tmp_path / "prof"
    [record] = [r for r in read_log(run) if "profile" in r]
    summary = record["profile"]
    assert summary["steps"] == [3, 4] and summary["trace"] == "profile_steps_2-4.json"
    assert summary["host_ms_per_step"] > 0 and summary["wall_ms_per_step"] >= summary["host_ms_per_step"]
    assert summary["device_ms_per_step"] is None  # no device on a CPU: the operators by host time instead
    top = summary["top"]  # the 10 operators with the most host time, each a positive share of all operators' time
    shares = [row["share"] for row in top]
    assert len(top) == 10 and all(share > 0 for share in shares) and sum(shares) <= 1 + 1e-9
    assert shares == sorted(shares, reverse=True)
    total_ms = top[0]["ms_per_step"] / shares[0]  # a share is the operator's time over all operators' time
    assert all(row["calls"] > 0 and row["ms_per_step"] == pytest.approx(row["share"] * total_ms) for row in top)
    trace = json.loads((run / summary["trace"]).read_text())
    traced = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in traced and {row["name"] for row in top} <= traced  # the matrix products were profiled
    text = (run / "log.txt").read_text()
    assert "profile of steps 3-4:" in text and "top operators by host time:" in text
    assert [r["step"] for r in read_log(run) if "train_loss" in r] == [1, 2, 3, 4, 5, 6]


def test_a_run_that_ends_inside_the_profile_window_still_writes_it(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "short", steps=3, **{"profile-steps": "1:9", "val-every": 0}))
    [record] = [r for r in read_log(tmp_path / "short") if "profile" in r]
    assert record["profile"]["steps"] == [2, 3] and (tmp_path / "short" / "profile_steps_1-3.json").is_file()


@pytest.mark.cuda
def test_no_host_sync_inside_a_training_step_on_cuda(tmp_path, monkeypatch):
    """The step (bias draw, forward, backward, optimizer, the loss read back) runs under torch's sync debug mode,
    which raises on any operation that waits for the device."""
    from tests.helpers import train_tiny_run

    def strict(method):
        def wrapped(self, *args):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return method(self, *args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return wrapped

    for name in ("train_step", "log_later"):  # log_later: the loss and the gradient norm on their way to the host
        monkeypatch.setattr(train_gpt.Trainer, name, strict(getattr(train_gpt.Trainer, name)))
    run = train_tiny_run(tmp_path, "--device", "cuda", "--grad-clip", "1.0", "--log-every", "2")
    losses = [r["train_loss"] for r in read_log(run) if "train_loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
