"""Run a grid of train_gpt.py runs on every GPU of a node (or CPU workers), then report and compare them.

    python -m grid --name paper --axis optimizer=ecd,adamw,sgdm,soap --axis bias-mode=none,bq,bqbv \\
        --axis seed=42,83 -- --preset gpt2-124m
    python -m grid --grid paper.toml                 # the same grid from a file (axes and shared flags)
    python -m grid status runs/paper                 # where a grid (running here or elsewhere) stands
    python -m grid report runs/paper                 # eval.report per finished run, then eval.compare
    python -m grid --grid paper.toml --submit        # on a Slurm cluster: a job array, then the report

Each --axis FLAG=V1,V2,... names a train_gpt.py flag; everything after -- goes to every run. A run per combination
goes to <--run-dir>/<--name>/<flag=value,...>. On CUDA each run gets one GPU (CUDA_VISIBLE_DEVICES), or N under
torchrun with --gpus-per-run N; on a CPU --workers N processes share the cores. The same command again skips
finished runs, resumes interrupted ones, waits for runs their trainers still hold, reruns failed ones only with
--retry-failed, and refuses runs trained with other flags; Ctrl-C (or the grid process dying) stops every run with a
checkpoint. At the end: eval.report for each finished run and DIR/compare.md (docs/grid.md). On a Slurm cluster
--print-slurm prints a job-array script (one task per run, each running `python -m grid task DIR RUN`) and --submit
submits it with the report as a job after it (docs/grid.md#on-a-slurm-cluster).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import socket
import sys
from pathlib import Path

import cli
import fileio
from grid import estimate, execute, memory, plan, progress, report, slurm
from run import directory

def visible_gpus(given: str | None) -> list[str]:
    """The GPUs runs may use: --gpus, else CUDA_VISIBLE_DEVICES's, else every GPU torch sees (none without CUDA)."""
    if given:
        return [g.strip() for g in given.split(",") if g.strip()]
    import torch

    if not torch.cuda.is_available():
        return []
    listed = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return listed or [str(i) for i in range(torch.cuda.device_count())]


def gpu_memory(given_gib: float | None) -> int | None:
    """Bytes of each GPU: --gpu-memory, else the smallest GPU torch sees, else None (none here)."""
    if given_gib is not None:
        return int(given_gib * memory.GIB)
    import torch

    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def gpu_name() -> str | None:
    """The name of the first GPU torch sees (the key of bench/throughput.json's rows), None without CUDA."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def run_parser() -> cli.ArgumentParser:
    parser = cli.ArgumentParser(module="grid", description=__doc__)
    parser.add_argument("--name", help="the grid's name: its runs go to <--run-dir>/<name>/ (or name in --grid)")
    parser.add_argument("--axis", action="append", default=[], metavar="FLAG=V1,V2",
                        help="a train_gpt.py flag and its values (repeatable; the first axis varies slowest)")
    parser.add_argument("--grid", type=Path, metavar="FILE.toml", help="axes and shared flags from a TOML file "
                        "(docs/grid.md#grid-files); --name, --axis and flags after -- override it")
    parser.add_argument("--run-dir", default=None, help="parent of the grid's directory (default: runs)")
    parser.add_argument("--scale", choices=plan.SCALES, default="paper", help="cpu: the same grid with every run "
                        "shrunk to seconds on a CPU (the trainer's cpu preset, given as flags), in <name>-cpu "
                        "(docs/reproduce.md#cpu-scale; default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1, help="CPU runs: processes at once, the cores divided "
                        "between them (default: %(default)s)")
    parser.add_argument("--gpus-per-run", type=int, default=1, help="CUDA runs: GPUs per run; more than 1 runs "
                        "each under torchrun (default: %(default)s)")
    parser.add_argument("--gpus", default=None, help="comma-separated GPU ids to use (default: every visible GPU)")
    parser.add_argument("--runs-per-gpu", type=int, default=1, help="CUDA runs: runs that share each GPU (or each "
                        "--gpus-per-run group) at once; refused when a memory estimate says they do not fit "
                        "(default: %(default)s)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB", help="memory of each GPU for that "
                        "check (default: what torch reports; give it to plan on a machine without the GPUs)")
    parser.add_argument("--retry-failed", action="store_true", help="run again the runs whose last attempt failed")
    parser.add_argument("--dry-run", action="store_true", help="print the runs, their commands and placement; "
                        "start nothing")
    cluster = parser.add_argument_group("a Slurm cluster (docs/grid.md#on-a-slurm-cluster)")
    cluster.add_argument("--print-slurm", action="store_true", help="print a Slurm job-array script (one array task "
                         "per run) instead of running; the plan goes to DIR/grid.jsonl, the tasks' output to DIR/logs")
    cluster.add_argument("--submit", action="store_true", help="submit that script (DIR/grid.sbatch) with sbatch, and "
                         "unless --no-report the report as a job that starts when the array has ended")
    cluster.add_argument("--slurm-time", metavar="TIME", help="each task's time limit (#SBATCH --time), e.g. 24:00:00")
    cluster.add_argument("--slurm-partition", metavar="NAME", help="the partition (#SBATCH --partition)")
    cluster.add_argument("--slurm-account", metavar="NAME", help="the account charged (#SBATCH --account)")
    cluster.add_argument("--slurm-qos", metavar="NAME", help="the quality of service (#SBATCH --qos)")
    cluster.add_argument("--slurm-option", action="append", default=[], metavar="--OPTION=VALUE",
                         help="another #SBATCH line (repeatable), e.g. --slurm-option=--constraint=h100")
    cluster.add_argument("--slurm-stop-before", type=int, default=300, metavar="SECONDS", help="Slurm warns each task "
                         "this long before its time limit; the task then stops its run with a checkpoint and requeues "
                         "itself (default: %(default)s)")
    parser.add_argument("--no-report", action="store_true", help="skip eval.report and eval.compare at the end")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--quick", action="store_true", help="report with the quick evaluation set whatever "
                        "the runs' size (default: quick for runs under 20M tokens)")
    budget.add_argument("--full", action="store_true", help="report with the full evaluation set")
    parser.add_argument("--status-every", type=float, default=60.0, metavar="SECONDS",
                        help="when the output is not a terminal, print the table this often (default: %(default)s)")
    return parser


def print_plan(spec, runs, states, slots, gpus_per_run: int, runs_per_gpu: int, memory_text: str) -> None:
    """--dry-run: every run, its state, where the first wave goes, and its command with the slot's environment."""
    sizes = " × ".join(f"{a.flag} {len(a.values)}" for a in spec.axes)
    print(f"grid {spec.name} in {spec.directory}: {len(runs)} runs ({sizes}); slots: "
          + (", ".join(s.label for s in slots) or "none"))
    print(memory_text)
    free = list(slots)
    for run in runs:
        state = states[run.name]
        if state == "invalid":
            print(f"  [invalid]  {run.name}: {run.problem}")
            continue
        if state in ("finished", "failed"):
            print(f"  [{state}] {run.name}" + (" (--retry-failed runs it again)" if state == "failed" else ""))
            continue
        slot = next((s for s in free if s.kind == run.device), None)
        if slot is not None:
            free.remove(slot)
        if state == "held":
            print(f"  [held] {run.name}: its trainer still runs ({directory.run_holder(run.path)}): the grid waits "
                  "for it" + (f" in {slot.label}" if slot else ""))
            continue
        print(f"  [{state}] {run.name} -> {slot.label if slot else 'queued: the next free ' + run.device + ' slot'}")
        env = slot.env if slot else next(s.env for s in slots if s.kind == run.device)
        command = plan.train_command(run, gpus_per_run if run.device == "cuda" else 1, state == "resume")
        print("      " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(command))
    from eval import power  # the published numbers and the trainer: not imported by `status`

    print("\n".join(estimate.wall_time_lines(runs, states, slots, gpu_name(), runs_per_gpu)
                    + power.power_lines([r.config.to_dict() for r in runs if r.config is not None])))


def plan_grid(args: argparse.Namespace, shared: list[str]):
    """(spec, train_gpt.py's flags, visible GPUs), every flag checked, and `args.slurm` (the Slurm script's options,
    None without --print-slurm or --submit); plan.GridError for a grid that cannot run as given."""
    spec = plan.scaled(plan.build_spec(args.name, args.run_dir, args.axis, shared, args.grid), args.scale, len(shared))
    known = plan.train_flags()
    plan.check_flags(spec, known)
    if min(args.workers, args.gpus_per_run, args.runs_per_gpu) < 1:
        raise plan.GridError("--workers, --gpus-per-run and --runs-per-gpu take a number of at least 1")
    if args.gpu_memory is not None and not 0 < args.gpu_memory < 2**33:  # NaN and infinity too (bytes in int64)
        raise plan.GridError(f"--gpu-memory {args.gpu_memory}: a GPU's memory in GiB, e.g. 80")
    script_flag = "--print-slurm" if args.print_slurm else "--submit" if args.submit else None
    if args.print_slurm + args.submit + args.dry_run > 1:
        raise plan.GridError("--dry-run, --print-slurm and --submit: give one")
    if script_flag and args.runs_per_gpu > 1:
        raise plan.GridError(f"--runs-per-gpu: a Slurm array gives each run a task and a GPU of its own; drop it "
                             f"with {script_flag}")
    defaults = run_parser()
    given = [name for name, value in vars(args).items()
             if name.startswith("slurm_") and value != defaults.get_default(name)]
    if given and not script_flag:
        raise plan.GridError(f"{cli.option(given[0])}: a flag of the Slurm script; give it with --print-slurm or "
                             "--submit")
    args.slurm = slurm.SlurmOptions.from_args(args) if script_flag else None  # each value checked
    if problem := cli.value_problem("status_every", args.status_every, "> 0"):
        raise plan.GridError(problem)
    gpus = visible_gpus(args.gpus)
    if args.gpus and not (args.dry_run or script_flag) and not visible_gpus(None):
        raise plan.GridError(f"--gpus {args.gpus}: torch sees no CUDA device here (plan with --dry-run or "
                             "--print-slurm)")
    if gpus and len(gpus) < args.gpus_per_run:
        raise plan.GridError(f"--gpus-per-run {args.gpus_per_run}: only {len(gpus)} GPUs are visible "
                             f"({','.join(gpus)})")
    return spec, known, gpus


def check_history(spec, runs) -> None:
    """plan.GridError when a run that trained before (finished, holding a checkpoint, or still running) did so with
    other flags than the grid asks now: it would count as this grid's run (docs/grid.md#running)."""
    changed = {}
    for run in runs:
        trained = (progress.run_finished(run.path, run.steps, run.stop_at_target)
                   or directory.run_holds_checkpoint(run.path) or directory.run_holder(run.path))
        if run.problem is None and trained and (differences := plan.recorded_changes(run)):
            changed[run.name] = differences
    if changed:
        name, differences = next(iter(changed.items()))
        raise plan.GridError(f"{len(changed)} of the runs in {spec.directory} were trained with other flags than "
                             f"this grid gives, or record none, e.g. {name}: {', '.join(differences)}; train these "
                             "flags in a new directory (another --name), or give the flags the runs were trained with")


def finish_grid(args, spec, runs, scheduler: execute.Scheduler, states: dict[str, str]) -> int:
    """After the runs: name each run that did not finish (with the end of its output), report and compare the
    finished ones; 0, 1 when a run or a report failed, 128 + the signal that interrupted the reports."""
    finished = [r for r in runs if progress.run_finished(r.path, r.steps, r.stop_at_target)]
    failed = [r for r in runs if r not in finished]
    for run in failed:
        state = scheduler.states.get(run.name, {})
        error = state.get("error") if not run.problem else None
        print(f"grid: NOT FINISHED {run.name}: {run.problem or state.get('state', states[run.name])}"
              + ("\n    " + error.replace("\n", "\n    ") if error else ""), file=sys.stderr)
    code = 0
    if not args.no_report:
        budget = ["--quick"] if args.quick else ["--full"] if args.full else []
        code = report.report_grid(spec.directory, [r.path for r in finished], budget, [r.name for r in failed],
                                  scheduler.slots)
    print(f"grid {spec.name}: {len(finished)} of {len(runs)} runs finished"
          + (f"; {len(failed)} did not (above)" if failed else "")
          + ("" if args.no_report or not finished or code else f"; comparison: {spec.directory / 'compare.md'}"))
    return code or (1 if failed else 0)


def start_record(argv: list[str], runs, gpus_per_run: int, estimates: dict | None = None, slots=(),
                 runs_per_gpu: int = 1, **extra) -> dict:
    """grid.jsonl's plan of this invocation: the command, every run (with its memory estimate, memory.grid_memory's
    `estimates`) and the slots."""
    estimates = estimates or {}
    return {"event": "start", "pid": os.getpid(), "host": socket.gethostname(), "argv": argv,
            "runs": [{**r.record(), "memory_gib": round(sum(estimates.get(r.name, {}).values()) / memory.GIB, 2)}
                     for r in runs],
            "slots": [s.label for s in slots], "gpus_per_run": gpus_per_run, "runs_per_gpu": runs_per_gpu, **extra}


def prepare_default_data(runs, stream=sys.stdout) -> None:
    """The default data (no --train-files) prepared once, before runs start that would each prepare it."""
    if any(not run.train_files for run in runs):
        from data import lookup  # torch: not imported by `status`

        print("grid: preparing the default data once for every run", file=stream, flush=True)
        lookup.resolve_data_files("", "")


def slurm_grid(args: argparse.Namespace, argv: list[str], spec, runs) -> int:
    """--print-slurm and --submit: the plan into DIR/grid.jsonl (what each array task reads), DIR/logs made (Slurm
    opens each task's output file there before the task starts) and the default data prepared, then the array's
    script printed, or submitted with the report as a job that waits for it."""
    if args.submit:
        slurm.sbatch_command()  # refused before anything is written
    lock = execute.claim(spec.directory)
    (spec.directory / "logs").mkdir(exist_ok=True)
    journal = execute.Journal(spec.directory)
    journal.append(start_record(argv, runs, args.gpus_per_run, slurm={"job_name": f"grid-{spec.name}"}))
    valid = [r for r in runs if r.problem is None]
    prepare_default_data(valid, sys.stderr)
    script = slurm.array_script(spec, runs, args.gpus_per_run, args.slurm, args.retry_failed)
    logs = f"{spec.directory.absolute() / 'logs'}/slurm-<job>_<task>.log"
    if args.print_slurm:
        print(script, end="")
        print(f"grid {spec.name}: {len(valid)} runs planned in {journal.path}; Slurm writes each task's output to "
              f"{logs}: submit the script with sbatch", file=sys.stderr)
    else:
        budget = ["--quick"] if args.quick else ["--full"] if args.full else []
        report_text = None if args.no_report else slurm.report_script(spec, any(r.device == "cuda" for r in valid),
                                                                      args.slurm, budget)
        array, after = slurm.submit(spec, script, report_text)
        journal.append({"event": "submitted", "array": array, "report": after})
        print(f"grid {spec.name}: {len(valid)} runs submitted as Slurm array job {array} (its script: "
              f"{spec.directory / 'grid.sbatch'}; each task's output: {logs})"
              + (f"; the report runs when it has ended, as job {after}" if after else "")
              + f"; `python -m grid status {spec.directory}` shows the runs")
    lock.close()
    return 0


def run_grid(argv: list[str]) -> int:
    cut = argv.index("--") if "--" in argv else len(argv)
    args = run_parser().parse_args(argv[:cut])
    spec, known, gpus = plan_grid(args, argv[cut + 1:])
    runs = plan.plan_runs(spec, known, args.gpus_per_run, bool(gpus) or args.slurm is not None)
    if all(r.problem for r in runs):
        raise plan.GridError(f"train_gpt.py refuses every run of the grid, e.g. {runs[0].name}: {runs[0].problem}")
    check_history(spec, runs)
    if args.slurm is not None:
        return slurm_grid(args, argv, spec, runs)
    lock = None if args.dry_run else execute.claim(spec.directory)
    estimates = memory.grid_memory(runs, args.gpus_per_run)
    gpu_bytes = gpu_memory(args.gpu_memory)
    if gpu_bytes is not None and (problem := memory.fit_problem(estimates, args.runs_per_gpu, gpu_bytes)):
        raise plan.GridError(problem)
    slots = execute.make_slots(gpus, args.gpus_per_run, args.workers, len(os.sched_getaffinity(0)),
                               {r.device for r in runs if r.problem is None}, args.runs_per_gpu)
    if args.runs_per_gpu > 1 and not any(slot.kind == "cuda" for slot in slots):
        print(f"grid: --runs-per-gpu {args.runs_per_gpu} applies to runs on GPUs; these runs are on the CPU, where "
              "--workers sets how many train at once", flush=True)
        args.runs_per_gpu = 1
    journal = execute.Journal(spec.directory)
    previous = journal.states()
    states = {r.name: execute.initial_state(r, previous.get(r.name, {}), args.retry_failed) for r in runs}
    if args.dry_run:
        print_plan(spec, runs, states, slots, args.gpus_per_run, args.runs_per_gpu,
                   memory.memory_line(estimates, args.runs_per_gpu, gpu_bytes))
        return 0
    journal.append(start_record(argv, runs, args.gpus_per_run, estimates, slots, args.runs_per_gpu))
    for run in runs:
        if states[run.name] == "invalid" and previous.get(run.name, {}).get("error") != run.problem:
            journal.append({"run": run.name, "state": "invalid", "error": run.problem})
    todo = [(r, states[r.name]) for r in runs if states[r.name] in ("new", "resume", "held")]
    counts = {s: list(states.values()).count(s) for s in ("new", "resume", "held", "finished", "failed", "invalid")}
    print(f"grid {spec.name}: {len(runs)} runs in {spec.directory}: {counts['new']} to start, {counts['resume']} to "
          f"resume, " + (f"{counts['held']} still held by their trainers (waited for), "
                         if counts["held"] else "")
          + f"{counts['finished']} finished, {counts['failed']} failed before (--retry-failed runs them), "
          f"{counts['invalid']} refused by train_gpt.py; slots: {', '.join(s.label for s in slots)}", flush=True)
    prepare_default_data([run for run, _ in todo])
    scheduler = execute.Scheduler(spec.directory, spec.name, runs, slots, journal,
                                  progress.Display(plain_every=args.status_every))
    try:
        code = scheduler.execute(todo) if todo else 0
    except OSError as exc:  # the grid's own files or its output, while runs train: say what became of them
        raise plan.GridError(f"{fileio.filesystem_error_line(exc, '--run-dir')}; the grid stopped" + (
            f", and each of the {scheduler.launched} runs it had started stopped with a checkpoint where it could; "
            "the same command continues them once fixed" if scheduler.launched else " before it started any run"))
    if code:
        print("grid: stopped by a signal; every run wrote a checkpoint where it could. The same command continues "
              "the grid.", file=sys.stderr)
    else:
        code = finish_grid(args, spec, runs, scheduler, states)
    journal.append({"event": "end", "rc": code})
    lock.close()
    return code


def grid_status(argv: list[str]) -> int:
    parser = cli.ArgumentParser(module="grid status", description="Where a grid stands: each run's state, step, "
                                "last loss, tokens/s, ETA and device, from DIR/grid.jsonl and the runs' logs.")
    parser.add_argument("directory", type=Path, help="the grid's directory (<run-dir>/<name>)")
    args = parser.parse_args(argv)
    journal = execute.Journal(args.directory)
    last_plan = journal.plan()
    states = journal.states()
    holder = execute.grid_holder(args.directory)
    now = {p["name"]: execute.current_state(p, states.get(p["name"], {}), holder is not None
                                            or slurm.task_holder(args.directory, p["name"]) is not None)
           for p in last_plan["runs"]}
    rows = [progress.progress_row(p, {**states.get(p["name"], {}), "state": now[p["name"]]})
            for p in last_plan["runs"]]
    print(progress.summary_line(args.directory.name, [row[1] for row in rows]))
    if last_plan.get("runs_per_gpu", 1) > 1:
        heaviest = max((p.get("memory_gib", 0) for p in last_plan["runs"]), default=0)
        print(f"{last_plan['runs_per_gpu']} runs share each GPU (about {heaviest:.1f} GiB each at most, estimated)")
    print("\n".join(progress.progress_table(rows)))
    held = sum(state == "running" for state in now.values())
    if holder or not last_plan.get("slurm"):
        print(f"running: {holder}" if holder else "no grid process is running here: the grid command continues it"
              + (f" ({held} of its runs still held by their trainers, which it waits for)" if held else ""))
    else:
        print(f"a Slurm job array runs this grid ({held} runs running now; `squeue --name "
              f"{last_plan['slurm']['job_name']}` lists its tasks): submitting its script again continues it")
    for p in last_plan["runs"]:
        state = states.get(p["name"], {})
        if now[p["name"]] in ("failed", "invalid"):
            print(f"{p['name']}: {now[p['name']]}: " + (state.get("error") or p.get("problem") or ""))
        elif now[p["name"]] == "missing":
            print(f"{p['name']}: missing: it finished, but its directory {p['path']} is gone; the grid command trains "
                  "it again")
    return 0


def grid_report(argv: list[str]) -> int:
    parser = cli.ArgumentParser(module="grid report", description="eval.report for every finished run of a grid, "
                                "then eval.compare into DIR/compare.md.")
    parser.add_argument("directory", type=Path, help="the grid's directory (<run-dir>/<name>)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--quick", action="store_true", help="the quick evaluation set for every run")
    budget.add_argument("--full", action="store_true", help="the full evaluation set for every run")
    parser.add_argument("--workers", type=int, default=1, help="reports at once without GPUs (default: %(default)s)")
    parser.add_argument("--gpus", default=None, help="comma-separated GPU ids, one report each at a time "
                        "(default: every visible GPU)")
    args = parser.parse_args(argv)
    planned = execute.Journal(args.directory).plan()["runs"]
    lock = execute.claim(args.directory)
    done = [p for p in planned if progress.run_finished(Path(p["path"]), p["steps"], p.get("stop_at_target", False))]
    others = [p["name"] for p in planned if p not in done]
    gpus = visible_gpus(args.gpus)
    slots = execute.make_slots(gpus, 1, max(args.workers, 1), len(os.sched_getaffinity(0)),
                               {"cuda"} if gpus else {"cpu"})
    code = report.report_grid(args.directory, [Path(p["path"]) for p in done],
                              ["--quick"] * args.quick + ["--full"] * args.full, others, slots)
    lock.close()
    return code


def grid_task(argv: list[str]) -> int:
    parser = cli.ArgumentParser(module="grid task", description="One run of a grid as a Slurm array task runs it "
                                "(the script of --print-slurm): trained, resumed or skipped as the grid command "
                                "would, as the last plan in DIR/grid.jsonl gives it; requeued when Slurm's warning "
                                "before the time limit stopped it (docs/grid.md#on-a-slurm-cluster).")
    parser.add_argument("directory", type=Path, help="the grid's directory (<run-dir>/<name>)")
    parser.add_argument("run", help="the run's name, its directory in the grid's")
    parser.add_argument("--retry-failed", action="store_true", help="run it again if its last attempt failed")
    args = parser.parse_args(argv)
    try:
        return slurm.run_task(args.directory, args.run, args.retry_failed)
    except (plan.GridError, OSError) as exc:  # the run's own log says it too, not only the task's output
        with contextlib.suppress(OSError):
            slurm.note_in_run_log(args.directory, args.run, f"error: {exc}")
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"status": grid_status, "report": grid_report, "task": grid_task}
    where = "place (copy the grid directory there)" if argv[:1] and argv[0] in commands else "--run-dir"
    try:
        code = commands[argv[0]](argv[1:]) if argv and argv[0] in commands else run_grid(argv)
        sys.stdout.flush()  # here, not at exit: an output pipe closed early is said below
        return code
    except plan.GridError as exc:  # a grid that cannot run as given: one line naming what to change
        fileio.print_error(str(exc))
        return 2
    except OSError as exc:  # the grid's own files before any run started, or what `status` and `report` read
        fileio.print_error(fileio.filesystem_error_line(exc, where))
        return 2
    except KeyboardInterrupt:  # before any run started (while planning), or in a report of its own
        print("\ngrid: interrupted; the same command continues", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
