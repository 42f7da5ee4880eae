"""A process that has imported the trainer once and forks a rank for each request (tests.helpers.ranks).

Starting a rank costs about 2 s of CPU before it does anything: importing torch, then torch._dynamo (which every
torch.optim optimizer imports when it is built). A test suite that starts dozens of ranks pays that again for each.
This process pays it once: it imports what every rank imports, stays single-threaded (it never runs a torch op, so no
thread pool exists when it forks), and for each request forks a child that becomes `python SCRIPT ARGS...` in the
given environment and directory, with its output in the given files. The child runs the script as `__main__`
(runpy), exactly as the interpreter would, and exits with the script's status; its status also goes to a file,
since its parent is this process and not the test.

Protocol, one JSON object per line on stdin: {"script", "args", "env", "cwd", "stdout", "stderr", "status"}; each
answered with the child's pid on a line of stdout. Children are reaped here (SIGCHLD ignored), so a pid that no
longer exists has ended.
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import sys
import traceback


def become(request: dict) -> int:
    """In the forked child: the request's environment, directory, output and argv, then its script as __main__."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    quiet = os.open(os.devnull, os.O_RDONLY)  # not the requests' pipe
    os.dup2(quiet, 0)
    os.close(quiet)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
    try:
        runpy.run_path(request["script"], run_name="__main__")
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # SystemExit("message"): the interpreter prints it and exits 1
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    return code


PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "train_gpt")  # torch._dynamo: what building an optimizer imports


def serve() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped as they end
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = become(request)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                with open(request["status"], "w") as status:
                    status.write(str(code))
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    serve()
