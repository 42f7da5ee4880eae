"""Evaluations of trained runs, each a command (`python -m eval.NAME --run runs/NAME`) writing into <run>/eval/
(docs/evaluation.md). Nothing is imported here:

    eval.target         what an evaluation command works on: --checkpoint, --out, --device, the checkpoint loaded
    eval.outputs        what it writes: <run>/eval/, strict JSON, Markdown tables, each output's checkpoint recorded
    eval.configuration  a run's config.json read back: its training settings, its validation shards
    eval.val_loss       validation loss on a fixed token budget, at the mean biases
    eval.logic_puzzles  logic puzzles: the expected token in the top-1 / top-5, and the logic loss, per category
    eval.alignment      b_Q alignment with the keys of every token, and its semantic enrichment
    eval.dynamics       angular momentum and rotational fraction of the attention heads, checkpoint by checkpoint
    eval.structure      symmetry and directionality of the query-key matrices
    eval.gauge          the gauge-sensitivity diagnostic's command and report (its computation: gauge.sensitivity)
    eval.curves         loss curves from log.jsonl, as measured, on one token axis across a resume
    eval.figures        the figures: matplotlib off-screen, PNGs written atomically, error bars, per-head heat maps
    eval.report         one page per run (report.md) linking every figure, running the evaluations it lacks
    eval.samples        runs as samples: one value per seed, mean ± std, differences with their error; intervals
    eval.compare        runs compared: the optimizer × attention-bias table and the per-run table
    eval.paper_data     the published numbers as data (eval/published/*.toml), read and checked entry by entry
    eval.paper_run      what the paper's run is, and each way a run differs from it
    eval.verdicts       the scorecard's verdict rule: t intervals, the least of k seeds, the seeds that decide a claim
    eval.scorecard      runs against the numbers the paper published, cell by cell
    eval.calibration    the verdict rule under simulation: how often each kind of world is called reproduced
    eval.power          what a grid can decide before it runs: each claim's power and the seeds it would need
"""
