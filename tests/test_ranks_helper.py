"""tests.helpers.ranks, which the multi-rank tests rely on: each rank forked from tests/zygote.py behaves as
`python SCRIPT ARGS` would (argv, environment, directory, output, exit status), and a failing rank ends the others."""
from __future__ import annotations

import signal
from pathlib import Path

from tests.helpers import ranks

SCRIPT = """\
import os, sys
print("argv", sys.argv[1:], "rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "in", os.getcwd(),
      "name", __name__)
"""


def test_a_forked_rank_is_the_script_run_as_main_with_its_argv_environment_and_directory(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    script = tmp_path / "show.py"
    script.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    result = ranks(["a", "--b=1"], nproc=3, script=script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"argv ['a', '--b=1'] rank {rank} of 3 in {tmp_path} name __main__"
                                          for rank in range(3)]


def test_exit_statuses_are_the_interpreters(tmp_path: Path) -> None:
    """sys.exit(n) is n, an uncaught exception 1 with its traceback on stderr, SystemExit("text") 1 with the text;
    the status of the first rank that failed is returned."""
    cases = {"raise SystemExit(3)": (3, ""), "raise RuntimeError('boom')": (1, "RuntimeError: boom"),
             "raise SystemExit('said why')": (1, "said why")}
    for body, (code, stderr) in cases.items():
        script = tmp_path / "fail.py"
        script.write_text(f"import os\nif os.environ['RANK'] == '1':\n    {body}\n")
        result = ranks([], script=script)
        assert result.returncode == code and stderr in result.stderr, (body, result)


def test_once_a_rank_fails_the_others_are_killed_after_the_grace_period(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text("import os, time\nif os.environ['RANK'] == '1':\n    raise SystemExit(5)\ntime.sleep(600)\n")
    assert ranks([], script=script, grace=0.5).returncode == 5
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert ranks([], script=script).returncode == -signal.SIGKILL  # ended with no status of its own: killed
