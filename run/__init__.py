"""A training run's machinery, one concern per module (docs/runs.md); import the module you need, nothing is
imported here:

    run.process         where a process trains: process group, device, autocast, batch layout, peak FLOPs for MFU
    run.checkpoint      the checkpoint format: atomic writes with a checksum per entry, verified reads, resume
    run.training_state  what a resume restores (model, optimizer, loader, generators, hooks) and --init-from's weights
    run.directory       the run directory: choosing it, its lock, clearing crashed writers' leftovers, opening it
    run.log             log.txt, log.jsonl, the trackers (W&B, TensorBoard), the lines a run ends with
    run.stop            stop requests every rank agrees on, and the message of a non-finite stop
    run.capture         the training step replayed from a CUDA graph, its static buffers, and why a step cannot be
"""
