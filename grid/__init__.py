"""A grid of training runs from one command: `python -m grid` (docs/grid.md). Nothing is imported here:

    grid.__main__  the command: plan, check, place and run the grid, `status`, `report` and `task`
    grid.plan      the axes and shared flags (command line or TOML), the scale (`--scale cpu`: the trainer's cpu
                   preset), one run per combination, each checked by train_gpt.py's own parser, and the command that
                   trains or resumes it
    grid.execute   placement on GPUs or CPU workers, the one loop that runs the queue (runs, then reports), signals,
                   `grid.jsonl` and the directory's lock
    grid.memory    a run's GPU memory, asked of the trainer's model and optimizer, and whether --runs-per-gpu fit
    grid.estimate  the grid's expected wall time, from the throughput its runs measured or bench/throughput.json
    grid.progress  the live table and `python -m grid status`
    grid.report    eval.report for every finished run and eval.compare over the grid
    grid.slurm     the grid as a Slurm job array: its script, its submission with the report after it, and what each
                   task runs

What the grid knows of a run comes from the trainer's modules (its parser, presets, model, optimizer, and run.log's
"finished"); the grid's functions that ask them import them, so that `status` and a Slurm task import no torch.
"""
