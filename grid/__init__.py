"""A grid of training runs from one command: `python -m grid` (docs/grid.md).

plan.py: the axes and shared flags (command line or TOML), one run per combination, each checked by train_gpt.py's
own parser, and its command. execute.py: placement on GPUs or CPU workers, the queue, signals, `grid.jsonl` and the
directory's lock. progress.py: the live table and `python -m grid status`. report.py: eval.report per finished run
and eval.compare over the grid. slurm.py: the grid as a Slurm job array (its script, its submission with the report
after it, and what each task runs).
"""
