"""Which shards a run trains and validates on, and the record of them that config.json and checkpoints keep
(docs/data.md#what-a-run-records)."""
from __future__ import annotations

import glob
import hashlib
import os

import torch
import torch.distributed as dist

from data.loader import validation_batches
from data.shards import DIGEST_CACHE, cache_root, describe_shards


class DataChangedError(RuntimeError):
    """--resume found other training shards than the checkpoint trained on."""


def validation_beside(train_files: str) -> str | None:
    """The validation shards that data.tokenize (and the FineWeb-Edu download) writes beside training shards: for a
    glob whose file name reads `<prefix>_train_...`, `<prefix>_val_*.bin` in its folder when that matches files;
    None otherwise."""
    folder, name = os.path.split(train_files)
    prefix, sep, _ = name.rpartition("_train_")
    beside = os.path.join(folder, f"{prefix}_val_*.bin")
    return beside if sep and glob.glob(beside) else None


def resolve_data_files(train_files: str, val_files: str, is_master: bool = True) -> tuple[str, str, str | None]:
    """(training glob, validation glob, note): --train-files, else downloaded FineWeb-Edu, else the embedded corpus
    (the note says so); validation on --val-files, else on the same source's validation shards: with
    --train-files those beside them (validation_beside), else the training shards themselves (the note says so).
    Under torchrun the master prepares the embedded corpus, the others find it in the cache."""
    if train_files:
        if val_files:
            return train_files, val_files, None
        if beside := validation_beside(train_files):
            return train_files, beside, f"no --val-files: validating on {beside}, the shards beside --train-files"
        return train_files, train_files, ("no --val-files and no <prefix>_val_*.bin beside --train-files: validating "
                                          "on the training shards themselves; --val-files names validation shards")
    from data import fineweb_edu

    if fineweb_edu.fineweb_shards_present():
        return fineweb_edu.DEFAULT_TRAIN_PATTERN, val_files or fineweb_edu.DEFAULT_VAL_PATTERN, None
    from data.embedded import prepare_embedded_corpus

    if is_master:
        files = prepare_embedded_corpus()
    if dist.is_initialized():
        dist.barrier()
    train, val = files if is_master else prepare_embedded_corpus()
    return train, val_files or val, ("no --train-files and no FineWeb-Edu shards: using the embedded corpus "
                                     "(the docstrings of Python 3.11's standard library, shipped in "
                                     "data/embedded_corpus/)")


SPLITS = ("train", "val")


def training_data(hp, vocab_size: int, is_master: bool) -> tuple[str, str, dict | None, list[str]]:
    """(training glob, validation glob, data record, lines for the log) of the training flags `hp`: the files
    (resolve_data_files), the validation data checked before any step (a ShardError names the file and the fix),
    and on the master the record that config.json and checkpoints keep (describe_data; None on other ranks)."""
    train, val, note = resolve_data_files(hp.train_files, hp.val_files, is_master)
    validation_batches(val, hp.micro_batch, hp.seq_len, hp.val_tokens, vocab_size=vocab_size)
    if not is_master:
        return train, val, None, []
    record = describe_data({"train": hp.train_files, "val": hp.val_files}, {"train": train, "val": val})
    return train, val, record, [note] * bool(note) + [data_summary(record)]


def describe_data(given: dict[str, str], resolved: dict[str, str]) -> dict:
    """Per split ("train", "val"): the glob as given (empty: the default data), the resolved glob, each file with
    its token count and sha256, and the total tokens; and the data's `fingerprint`. Digests are cached by (path,
    size, mtime_ns) in the cache root (data.shards.sha256_shards), so only new or changed shards are read."""
    cache = cache_root() / DIGEST_CACHE
    record = {split: {"given": given[split], **describe_shards(resolved[split], cache)} for split in SPLITS}
    return {**record, "fingerprint": data_fingerprint(record)}


def data_fingerprint(record: dict) -> str:
    """16 hex digits naming the data by content (each split's shards in order: token counts and sha256, not paths):
    losses compare between runs only when their fingerprints are equal."""
    digest = hashlib.sha256()
    for split in SPLITS:
        files = record[split]["files"]
        digest.update((split + "".join(f" {f['tokens']}:{f['sha256']}" for f in files) + "\n").encode())
    return digest.hexdigest()[:16]


def data_summary(data: dict) -> str:
    splits = [f"{split} data {data[split]['pattern']}: {len(data[split]['files'])} files, {data[split]['tokens']:,} "
              "tokens" for split in SPLITS]
    return " | ".join(splits + [f"data fingerprint {data['fingerprint']}"])


def check_resumed_data(saved: dict | None, now: dict | None, device: torch.device) -> list[str]:
    """data_changes on the master, which holds the record `now` (None elsewhere), agreed by every rank (a
    collective under torchrun): DataChangedError on each when the training data differs, else the warnings."""
    problem, warnings = data_changes(saved, now) if now is not None else (None, [])
    refused = torch.tensor(float(problem is not None), device=device)
    if dist.is_initialized():
        dist.all_reduce(refused)
    if refused.item():
        raise DataChangedError(problem or "rank 0 found other training data than the checkpoint recorded")
    return warnings


def data_changes(saved: dict | None, now: dict) -> tuple[str | None, list[str]]:
    """(problem, warnings) from comparing a checkpoint's data record with the data found now, by contents (token
    counts and sha256 of the files in order), not paths. Other training data is a problem: the loader's position
    and the data order would mean nothing. Other validation data is a warning: losses before and after the resume
    are not comparable. Moved files with the same contents are fine."""
    if saved is None:
        return None, ["the checkpoint records no data (config.data is None): the data is not checked"]
    if not all(isinstance(part := saved.get(split), dict) and type(part.get("tokens")) is int
               and isinstance(part.get("files"), list) and all(isinstance(f, dict) and {"path", "tokens", "sha256"}
                                                               <= f.keys() for f in part["files"]) for split in SPLITS):
        return ("--resume: the checkpoint's config.data entry is damaged (not a record of the training and validation "
                "shards); restore the file, or resume from another checkpoint"), []
    problem, warnings = None, []
    for split in SPLITS:
        old, new = saved[split]["files"], now[split]["files"]
        if [(f["tokens"], f["sha256"]) for f in old] == [(f["tokens"], f["sha256"]) for f in new]:
            continue
        what = (f"the {split} data {now[split]['pattern']} is not what the checkpoint recorded: {len(new)} files / "
                f"{now[split]['tokens']:,} tokens now, {len(old)} files / {saved[split]['tokens']:,} tokens then")
        i = next((i for i, (a, b) in enumerate(zip(old, new)) if a["sha256"] != b["sha256"]), None)
        if i is not None:
            what += (f"; first difference at file {i}: recorded {old[i]['path']} (sha256 {old[i]['sha256'][:12]}..), "
                     f"now {new[i]['path']} (sha256 {new[i]['sha256'][:12]}..)")
        if split == "train":
            problem = (f"--resume: {what}. The data order and the loader's position would mean nothing on other "
                       "data: restore the recorded shards (the run's config.json lists them with their sha256), or "
                       "start a new run")
        else:
            warnings.append(f"WARNING: {what}. Validation losses before and after this resume are not comparable.")
    return problem, warnings
