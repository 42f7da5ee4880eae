"""bench/gpu_session.sh on the CPU with a fake interpreter standing in for the GPU machine's python3 (it answers each
step as the real module would, or hangs, as the test asks): at most 3 files come back, the report is the last
output and ends with the changes its numbers justify as a diff that applies to this code, runs sharing the GPU are
counted over the seconds they overlapped, the budget is kept, a hung test is stopped and the others still get their
verdicts, an environment failure ends the session at once, and SIGTERM still leaves a report. The real command on
this CUDA-less machine stops at the environment check."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_session, session_report
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.waits  # fake sessions that sleep, hang and are cut: ~25 s, ~4 s of it computing
TESTS = ["tests/test_ecd_kernels.py::test_fp32[ragged]", "tests/test_a.py::test_slow_hang", "tests/test_a.py::test_ok",
         "tests/test_a.py::test_fails"]
FAKE = r'''
import json, os, sys, time

def arg(name):
    return sys.argv[sys.argv.index(name) + 1]

def hang(step):
    if step in os.environ.get("FAKE_HANG", "").split(","):
        print(f"{step}: hanging", flush=True)
        time.sleep(600)

module = sys.argv[2] if sys.argv[1] == "-m" else ""
if module == "bench.session_env":
    hang("env")
    env = {"gpu": "Fake H100", "torch": "2.11.0", "triton": "3.6.0", "cuda": "12.8", "tokenizer_ranks": True}
    if os.environ.get("FAKE_ENV") == "nocuda":
        env["problem"] = "torch 2.11.0 sees no CUDA device"
    open(arg("--out"), "w").write(json.dumps(env))
    sys.exit(3 if "problem" in env else 0)
if module == "bench.attention":
    shape = {"B": 8, "H": 12, "T": 512, "d": 64, "causal": True, "complete": False,
             "variants": {"triton+bias": {"fwd_ms": 0.5, "x_fwd": 1.2, "fwd_bwd_ms": 2.0, "x_fwd_bwd": 1.1,
                                          "first_s": 9.0}}}
    open(arg("--out"), "w").write(json.dumps({"shapes": [shape]}))
    hang("attention")
    shape.update(complete=True, auto={"none": "sdpa", "+bias": "triton"})
    open(arg("--out"), "w").write(json.dumps({"shapes": [shape]}))
    table = json.loads(open(arg("--table")).read())
    table["rows"].append({"gpu": "Fake H100", "head_dim": 64, "dtype": "bfloat16", "impl": "triton",
                          "source": "fake: triton 2.000 ms, sdpa 2.200 ms"})
    open(arg("--table"), "w").write(json.dumps(table, indent=1) + "\n")
elif module == "bench.e2e":
    hang("e2e")
    graph = "reduce-overhead" in sys.argv
    out = arg("--out")
    runs = int(out.split("concurrent_")[1].split("_")[0]) if "concurrent_" in out else 1
    per_run = (400000.0 if graph else 200000.0) / (1 + 0.25 * (runs - 1))  # the GPU's share of each run
    start = float(os.environ.get("FAKE_EPOCH", time.time()))  # one timeline for runs started together
    records = [[start + 0.05 * k, 20 * k, per_run * 0.05 * k] for k in range(12)]
    time.sleep(0.6)
    result = {"batch_tokens": 4096, "tokens_per_s": per_run, "step_time_ms": 4096e3 / per_run, "mfu": 0.3,
              "train_loss": 7.25, "peak_memory_gib": 6.1, "records": records, "profile": None,
              "attention": {"choice": arg("--attention-impl") if "--attention-impl" in sys.argv else "sdpa"},
              "graph": ["CUDA graph: the training step is captured after 2 eager steps and replayed from now on"]
              if graph else []}
    if "--profile-steps" in sys.argv:
        result["profile"] = {"steps": [187, 188], "wall_ms_per_step": 21.0 if not graph else 10.5,
                             "host_ms_per_step": 13.0 if not graph else 0.4, "device_ms_per_step": 7.7, "trace": None,
                             "top": [{"name": "fake_gemm_kernel", "calls": 48, "ms_per_step": 3.0, "share": 0.4}]}
    open(out, "w").write(json.dumps(result))
elif module == "pytest":
    targets = [a for a in sys.argv[3:] if a.startswith("tests/")]
    chosen = [t for t in os.environ["FAKE_TESTS"].split(",") if any(t == x or x.endswith("/") or t.startswith(x + "::")
                                                                     for x in targets)]
    events = open(os.environ["SYMGPT_SESSION_EVENTS"], "a", buffering=1)
    for t in chosen:
        events.write(f"collected {t}\n")
    for t in chosen:
        events.write(f"start {t}\n")
        if "hang" in t:
            time.sleep(600)
        events.write(f"{'failed' if 'fails' in t else 'passed'} {t} 0.1\n")
    print(f"{len(chosen)} tests")
'''


@pytest.fixture()
def fake_python(tmp_path: Path) -> Path:
    path = tmp_path / "fake" / "python3"
    path.parent.mkdir()
    path.write_text(f"#!{sys.executable}\n{FAKE}")
    path.chmod(0o755)
    return path


def session(out: Path, python: Path | str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """bench/gpu_session.sh, bounded by 300 s: less than a fake hang (600 s), so a budget or limit not kept fails."""
    return subprocess.run(["bash", "bench/gpu_session.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OUT": str(out), "PYTHON": str(python),
                                            "SYMGPT_COMMIT": "abc1234", "FAKE_TESTS": ",".join(TESTS),
                                            "FAKE_EPOCH": str(time.time()), **env})


def test_a_session_returns_three_files_and_prints_its_report_last(tmp_path: Path, fake_python: Path) -> None:
    out = tmp_path / "out"
    proc = session(out, fake_python, "--budget", "60", "--test-limit", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "session.log"]
    markdown = (out / "report.md").read_text()
    assert proc.stdout.rstrip().endswith(markdown.rstrip())  # the tail of the output carries the numbers
    report = json.loads((out / "report.json").read_text())
    assert report["commit"] == "abc1234" and report["env"]["gpu"] == "Fake H100" and report["stopped"] is None
    assert [name for name, r in report["steps"].items() if r["status"] == "ok"] == [
        "env", "attention", "e2e_kernels", "e2e_graph", "concurrent_2", "concurrent_3"]
    assert report["attention"]["shapes"][0]["complete"]
    assert report["e2e"]["e2e_kernels"]["attention"]["choice"] == "triton"  # the attention step's choice
    assert report["profiles"]["e2e_graph"]["host_ms_per_step"] == 0.4
    for n, each in (("2", 400000 / 1.25), ("3", 400000 / 1.5)):  # in the faster mode, the graph's
        shared = report["concurrent"][n]
        assert shared["mode"] == "reduce-overhead" and shared["overlap_s"] > 0.2
        assert shared["tokens_per_s"] == pytest.approx(int(n) * each, rel=1e-6)
    verdicts = {t: r["verdict"] for t, r in report["tests"].items()}
    assert verdicts == {TESTS[0]: "passed", TESTS[1]: "timed out after 3 s", TESTS[2]: "passed",
                        TESTS[3]: "failed"}  # the hung test stopped, the rest run in a second pytest
    assert report["steps"]["cuda_tests"]["status"] == "1 failed, 2 passed, 1 timed out after 3 s"
    for text in ("| triton+bias | 0.500 | 1.20 | 2.000 | 1.10 | 9.0 |", "| default | triton | 200,000 | 20.48 |",
                 "21.00 ms per step = 2.73x the device's work", "| test_a.py::test_slow_hang | timed out after 3 s |",
                 "| 3 | reduce-overhead | 800,000 | 2.00 |",
                 "Left out to make room, most valuable first: the end-to-end"):
        assert text in markdown, text
    changes = markdown.split("## Changes these numbers justify")[1]
    assert "- grid --runs-per-gpu default: 3 (reduce-overhead, per GPU: 1 runs 400,000 tokens/s, 2 runs 640,000 " \
           "tokens/s, 3 runs 800,000 tokens/s; the best 2.00x one run's (target >= 1.5x))" in changes
    assert ("- train_gpt.py --compile-mode default: reduce-overhead (default 20.48 ms per step, reduce-overhead 10.24 "
            "ms per step; 1.33x its device time 7.70 ms (target <= 1.3x))") in changes
    diff = changes.split("```diff\n")[1].split("```")[0]
    for path in ("kernels/attention_table.json", "bench/throughput.json", "train_gpt.py", "grid/__main__.py",
                 "docs/grid.md"):
        assert f"+++ b/{path}" in diff
    assert '+        "reduce-overhead", "default, reduce-overhead' in diff and "default=3," in diff
    check = subprocess.run(["git", "apply", "--check", "-"], cwd=ROOT, input=diff, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr  # ready to apply to the code it ran
    log = (out / "session.log").read_text()
    assert markdown.rstrip().endswith("```") and log.count("-m bench.e2e") == 2 + 2 + 3


def test_the_budget_is_kept_and_a_cut_step_keeps_what_it_measured(tmp_path: Path, fake_python: Path) -> None:
    out = tmp_path / "out"
    proc = session(out, fake_python, "--budget", "12", FAKE_HANG="attention")  # a hang of 600 s
    report = json.loads((out / "report.json").read_text())
    assert report["steps"]["attention"]["status"].startswith("timed out")
    assert report["attention"]["shapes"][0]["complete"] is False  # the shape measured before the cut
    assert all(report["steps"][name]["status"] == "not run: no time left in the budget"
               for name in ("e2e_kernels", "e2e_graph", "concurrent_2", "concurrent_3"))
    tail = proc.stdout.split("# GPU session")[-1]
    assert "(cut short)" in tail and "None: no figure was measured." in tail


def test_an_environment_failure_ends_the_session_at_once(tmp_path: Path, fake_python: Path) -> None:
    out = tmp_path / "out"
    proc = session(out, fake_python, FAKE_ENV="nocuda")
    assert proc.returncode == 1
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == {"env": {"status": "failed", "seconds": report["steps"]["env"]["seconds"]}}
    assert "sees no CUDA device" in report["stopped"]
    assert f"| env | failed | {report['steps']['env']['seconds']} |  |" in proc.stdout
    assert proc.stdout.rstrip().endswith("## Changes these numbers justify\n\nNone: no figure was measured.")


def test_a_hung_environment_check_is_stopped_within_its_limit(tmp_path: Path, fake_python: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gpu_session, "ENV_LIMIT_S", 3)
    monkeypatch.setenv("FAKE_HANG", "env")
    before = signal.getsignal(signal.SIGTERM)
    assert gpu_session.main(["--out", str(tmp_path), "--python", str(fake_python)]) == 1  # not after the 600 s hang
    assert signal.getsignal(signal.SIGTERM) is before  # a later SIGTERM to this process is not taken for the session's
    assert "timed out after 3 s" in json.loads((tmp_path / "report.json").read_text())["stopped"]
    assert "**Stopped: environment check failed" in capsys.readouterr().out


def test_without_cuda_the_real_command_stops_at_the_environment_check(tmp_path: Path) -> None:
    proc = session(tmp_path, sys.executable)
    assert proc.returncode == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert "sees no CUDA device" in report["stopped"] and report["env"]["torch"]


def test_sigterm_stops_the_step_and_still_reports(tmp_path: Path, fake_python: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", "bench/gpu_session.sh"], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OUT": str(out), "PYTHON": str(fake_python), "FAKE_HANG": "e2e"})
    log = out / "session.log"
    wait_until(lambda: log.exists() and "e2e: hanging" in log.read_text(), "the e2e step hanging in session.log")
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=300)
    report = json.loads((out / "report.json").read_text())
    assert report["stopped"].startswith("SIGTERM") and report["steps"]["attention"]["status"] == "ok"
    assert report["steps"]["e2e_kernels"]["status"] == "stopped by SIGTERM"
    assert stdout.rstrip().endswith((out / "report.md").read_text().rstrip())


def test_the_commit_comes_from_the_environment_a_file_or_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYMGPT_COMMIT", "from-env")
    assert gpu_session.commit() == "from-env"
    monkeypatch.delenv("SYMGPT_COMMIT")
    monkeypatch.setattr(gpu_session, "REPO", tmp_path)  # a tree that travelled without .git
    assert gpu_session.commit() == "unknown (set SYMGPT_COMMIT)"
    (tmp_path / "SYMGPT_COMMIT").write_text("from-file\n")
    assert gpu_session.commit() == "from-file"


def test_the_printed_report_lists_only_the_tests_that_did_not_pass_when_long() -> None:
    tests = {f"tests/test_x.py::test_{i}": {"verdict": "passed", "seconds": 1.0} for i in range(300)}
    tests["tests/test_x.py::test_bad"] = {"verdict": "failed", "seconds": 1.0}
    report = {"commit": "c", "date": "d", "budget_s": 570, "elapsed_s": 1, "stopped": None, "env": None,
              "steps": {"cuda_tests": {"status": "1 failed, 300 passed"}}, "left_out": [], "attention": None,
              "table": None, "e2e": {}, "profiles": {}, "concurrent": {}, "tests": tests}
    assert len(session_report.markdown(report, ROOT)) > gpu_session.PRINT_LIMIT_CHARS
    compact = session_report.markdown(report, ROOT, compact=True)
    assert len(compact) < 2000 and "test_x.py::test_bad | failed" in compact and "test_7 " not in compact


def test_the_pytest_plugin_writes_each_verdict_as_it_happens(tmp_path: Path) -> None:
    events = tmp_path / "events.txt"
    test = tmp_path / "test_sample.py"
    test.write_text("import pytest\n\ndef test_good():\n    pass\n\ndef test_bad():\n    assert False\n\n"
                    "@pytest.fixture\ndef broken():\n    raise RuntimeError\n\ndef test_setup(broken):\n    pass\n\n"
                    "@pytest.mark.skip(reason='no')\ndef test_skipped():\n    pass\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench.session_tests",
                    "--rootdir", str(tmp_path), str(test)], cwd=ROOT, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "SYMGPT_SESSION_EVENTS": str(events)})
    lines = [line.rsplit(" ", 1)[0] if line[0] in "pfse" and not line.startswith("start") else line
             for line in events.read_text().splitlines()]
    name = f"{test.name}::test_"
    assert lines == [f"collected {name}good", f"collected {name}bad", f"collected {name}setup",
                     f"collected {name}skipped", f"start {name}good", f"passed {name}good", f"start {name}bad",
                     f"failed {name}bad", f"start {name}setup", f"error {name}setup", f"start {name}skipped",
                     f"skipped {name}skipped"]
