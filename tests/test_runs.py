"""The run machinery's contracts (run/, fileio.py; docs/runs.md): the checkpoint format and how older files are read
(v1 files resume bit-exactly, every layout of them), the training state it saves and restores, the checksum and the
tied embedding, the batch layout, a stop request, the lock a run or grid directory holds, atomic writes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import zipfile

import pytest
import torch

import train_gpt
from fileio import LockHeldError, atomic_write, atomic_writer, dead_temporaries, hold_lock, lock_holder
from optim import OPTIMIZERS
from run.checkpoint import (
    CHECKPOINT_FORMAT,
    CONFIG_ENTRIES,
    TRAINING,
    WEIGHTS,
    CheckpointError,
    Progress,
    entry_checksums,
    load_checkpoint,
    save_checkpoint,
    tensor_checksum,
    training_checkpoint,
    upgrade,
    weights_checkpoint,
)
from run.log import format_duration, read_log, record_numbers
from run.training_state import TrainingState
from run.process import batch_layout
from run.stop import StopRequest
from tests.helpers import (ENV, ROOT, VOCAB, resume_in_new_directory, tiny_args, tiny_gpt, train_losses,
                           write_v1_checkpoint)

# ----- the checkpoint format: today's written, v1, v2 and v3 read through one upgrade -----

BARE_CONFIG = {**{key: {} for key in CONFIG_ENTRIES}, "preset": None}  # every entry, each of its shape, no values


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_v1_checkpoint_of_every_optimizer_resumes_bit_exactly(corpus, tmp_path, optimizer):
    """The newest v1 layout (what the trainer wrote until v2): the next steps' losses equal the straight run's."""
    train_gpt.main(tiny_args(corpus, tmp_path, "straight", steps=4, optimizer=optimizer,
                             **{"val-every": 0, "checkpoint-every": 2, "keep-checkpoints": -1}))
    v1 = tmp_path / "v1.pt"
    write_v1_checkpoint(tmp_path / "straight" / "checkpoints" / "step_000002.pt", v1)
    assert torch.load(v1, weights_only=False)["format"] == "symgpt-checkpoint-v1"
    resumed = train_losses(resume_in_new_directory(v1, tmp_path / "resumed"))
    straight = train_losses(tmp_path / "straight")
    assert sorted(resumed) == [3, 4] and all(resumed[step] == straight[step] for step in resumed)
    assert next(r for r in read_log(tmp_path / "resumed") if "resumed_from" in r)["changed"] == {}
    again = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "latest.pt", verify=True)  # written as today's
    assert torch.load(tmp_path / "resumed" / "checkpoints" / "latest.pt", weights_only=False)["format"] == \
        CHECKPOINT_FORMAT and again["step"] == 4


def test_the_oldest_v1_layout_resumes_bit_exactly_with_its_gauge_state_and_preset(corpus, tmp_path):
    """Both embedding copies, no checksum, the gauge's state as "gauge", a sampler entry, research flags in the train
    section, --keep-checkpoints and --decay-groups as switches, no preset (the run's config.json has it) and no data
    record: the run resumes in its directory, keeps its preset, says the data is not checked, and continues the
    uninterrupted run's trajectory exactly."""
    flags = {"preset": "smoke", "steps": 4, "val-every": 0, "gauge": "correct", "weight-decay": 0.1,
             "decay-groups": "matrices+embeddings"}
    train_gpt.main(tiny_args(corpus, tmp_path, "straight", **flags))
    train_gpt.main(tiny_args(corpus, tmp_path, "old", **flags, **{"checkpoint-every": 2, "keep-checkpoints": -1}))
    run = tmp_path / "old"
    write_v1_checkpoint(run / "checkpoints" / "step_000002.pt", run / "checkpoints" / "latest.pt", oldest=True)
    raw = torch.load(run / "checkpoints" / "latest.pt", weights_only=False)
    assert {"gauge", "sampler"} <= set(raw) and not {"tied", "hooks", "checksum"} & set(raw)
    assert "research" not in raw["config"] and raw["config"]["train"]["keep_checkpoints"] is True
    (run / "log.jsonl").write_text("")
    train_gpt.main(["--resume", str(run)])
    resumed, straight = train_losses(run), train_losses(tmp_path / "straight")
    assert sorted(resumed) == [3, 4] and all(resumed[s] == straight[s] for s in resumed)
    record = next(r for r in read_log(run) if "resumed_from" in r)
    assert record["changed"] == {}  # every setting came back as it was
    assert "the checkpoint records no data" in (run / "log.txt").read_text()
    latest = load_checkpoint(run / "checkpoints" / "latest.pt")
    assert latest["config"]["preset"] == "smoke" and latest["config"]["train"]["keep_checkpoints"] == -1
    assert latest["hooks"]["gauge"]["mode"] == "correct"


@pytest.mark.parametrize("embeddings, rest, meant", [(False, False, "matrices"), (True, False, "matrices+embeddings"),
                                                     (False, True, "all-but-embeddings"), (True, True, "all")])
def test_v1_configs_from_before_decay_groups_keep_their_meaning(tmp_path, embeddings, rest, meant):
    old = {"format": "symgpt-checkpoint-v1", "step": 1, "model": {}, "config": {"optim": {
        "lr": 1.0, "decay_embeddings": embeddings, "decay_norms_and_biases": rest}}}
    assert upgrade(old, tmp_path / "x.pt", verify=False)["config"]["optim"]["decay_groups"] == meant
    unset = {"format": "symgpt-checkpoint-v1", "step": 1, "model": {}, "config": {"optim": {"lr": 1.0}}}
    assert upgrade(unset, tmp_path / "x.pt", verify=False)["config"]["optim"]["decay_groups"] == "matrices"


def test_the_v1_upgrade_fills_every_entry_and_keeps_what_v1_said(tmp_path):
    old = {"format": "symgpt-checkpoint-v1", "step": 5, "model": {}, "sampler": {"seed": 1}, "metrics": {},
           "optimizers": [{"state": {}}], "hooks": {}, "loader": {}, "rng": {},
           "config": {"model": {}, "train": {"keep_checkpoints": False, "gauge": "project", "seed": 3},
                      "optim": {"decay_groups": "all"}, "research": {"gauge_every": 7}}}
    new = upgrade(old, tmp_path / "x.pt", verify=False)
    assert new["format"] == CHECKPOINT_FORMAT and set(CONFIG_ENTRIES) <= set(new["config"]) and new["kind"] == TRAINING
    assert new["config"]["attention"] is None  # not recorded: readers take the default path
    assert new["optimizer"] == {"state": {}} and "optimizers" not in new and "sampler" not in new
    assert new["config"]["train"] == {"keep_checkpoints": 0, "seed": 3}
    assert new["config"]["research"] == {"gauge": "project", "gauge_every": 7, "gauge_project_velocity": False}
    assert new["config"]["data"] is None and new["config"]["preset"] is None and new["hooks"] == {}
    two = {"format": "symgpt-checkpoint-v1", "step": 1, "model": {}, "config": {}, "optimizers": [{}, {}]}
    with pytest.raises(CheckpointError, match="2 optimizer states"):
        upgrade(two, tmp_path / "x.pt", verify=False)


def test_a_newer_or_incomplete_format_or_an_unknown_kind_is_refused_naming_what_is_wrong(tmp_path):
    torch.save({"format": "symgpt-checkpoint-v9", "step": 1}, tmp_path / "new.pt")
    with pytest.raises(CheckpointError, match="format symgpt-checkpoint-v9, which this version does not read .* "
                                              "update the code"):
        load_checkpoint(tmp_path / "new.pt")
    torch.save({"format": CHECKPOINT_FORMAT, "step": 1, "model": {}, "tied": {}, "config": {"model": {}}},
               tmp_path / "cut.pt")
    with pytest.raises(CheckpointError, match="without metrics, kind, config.train, config.research, config.optim, "
                                              "config.data, config.preset, config.attention"):
        load_checkpoint(tmp_path / "cut.pt")
    whole = {"format": CHECKPOINT_FORMAT, "step": 1, "model": {}, "tied": {}, "metrics": {},
             "config": dict(BARE_CONFIG)}
    torch.save({**whole, "kind": TRAINING, "optimizer": {}}, tmp_path / "training.pt")
    with pytest.raises(CheckpointError, match="without loader, rng, hooks"):  # what resuming would need
        load_checkpoint(tmp_path / "training.pt")
    torch.save({**whole, "kind": "everything"}, tmp_path / "kind.pt")
    with pytest.raises(CheckpointError, match="of kind 'everything', which this version does not know"):
        load_checkpoint(tmp_path / "kind.pt")
    model = tiny_gpt(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=1, n_embd=8)
    with pytest.raises(ValueError, match="it has no data, preset, attention"):
        weights_checkpoint(model, {"model": {}, "train": {}, "research": {}, "optim": {}}, {"step": 0})


def test_a_v2_checkpoint_reads_with_its_kind_made_explicit(tmp_path):
    """v2 left the kind to the presence of an optimizer state and recorded no attention path; its checksum, over
    the same tensors, still verifies."""
    model = tiny_gpt(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=1, n_embd=8)
    config = {key: value for key, value in BARE_CONFIG.items() if key != "attention"}
    training = {"optimizer": {}, "loader": {}, "rng": {"torch": torch.get_rng_state()}, "hooks": {}}
    for kind, extra in ((WEIGHTS, {}), (TRAINING, training)):
        ckpt = weights_checkpoint(model, {**config, "attention": None}, {"step": 2}, **extra)
        del ckpt["kind"], ckpt["config"]["attention"]
        ckpt["format"] = "symgpt-checkpoint-v2"
        ckpt["checksum"] = tensor_checksum(ckpt)
        torch.save(ckpt, tmp_path / f"{kind}.pt")
        loaded = load_checkpoint(tmp_path / f"{kind}.pt", verify=True)
        assert loaded["format"] == CHECKPOINT_FORMAT and loaded["kind"] == kind
        assert loaded["config"]["attention"] is None and loaded["step"] == 2


def test_the_tied_embedding_is_stored_once_and_loads_back(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "tied"))
    path = tmp_path / "tied" / "checkpoints" / "latest.pt"
    raw = torch.load(path, weights_only=False)
    assert "lm_head.weight" not in raw["model"] and raw["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    model = train_gpt.model_from_checkpoint(path)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight, raw["model"]["transformer.wte.weight"])
    assert set(load_checkpoint(path)["model"]) == set(model.state_dict())  # every name, for eval/
    old = tmp_path / "old.pt"  # the oldest v1 layout stored both copies: one embedding larger, and it loads
    write_v1_checkpoint(path, old, oldest=True)
    def stored(file) -> int:  # bytes of tensor storage in torch.save's zip
        return sum(i.file_size for i in zipfile.ZipFile(file).infolist() if "/data/" in i.filename)

    assert stored(old) - stored(path) == VOCAB * 32 * 4
    again = train_gpt.model_from_checkpoint(old)
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


class Stateful:
    """A loader or a hook as the checkpoint sees them: a name, a state_dict, a load_state_dict."""

    name = "probe"

    def __init__(self, state: dict | None) -> None:
        self.state = state

    def state_dict(self) -> dict | None:
        return self.state

    def load_state_dict(self, state: dict, device: torch.device | None = None) -> None:
        self.state = state


def test_the_training_state_comes_back_whole_with_the_current_optimizer_settings(tmp_path):
    """What a resumed run continues from, through a checkpoint file: weights, optimizer state, loader position, hook
    state, RNG and Progress as saved; the optimizer's hyperparameters as this run built them (flags given on
    --resume take effect). A checkpoint of model weights only has nothing to restore."""
    def build(seed: int, lr: float) -> TrainingState:
        model = tiny_gpt(seed, vocab_size=VOCAB, block_size=8, n_layer=1, n_head=1, n_embd=8)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        settings = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
        return TrainingState(model=model, optimizer=opt, peak_settings=settings, loader=Stateful(None),
                             hooks=Stateful(None), device=torch.device("cpu"))

    saved = build(0, 1e-2)
    saved.model(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long))[1].backward()
    saved.optimizer.step()
    saved.loader.state, saved.hooks.state = {"position": 7}, {"gauge": {"mode": "correct"}}
    saved.progress = Progress(step=3, tokens=96, train_time_s=1.5, val_loss=4.0, val_step=2)
    rng = torch.get_rng_state()
    config = dict(BARE_CONFIG)
    save_checkpoint(tmp_path / "a.pt", training_checkpoint(config, saved.state_dict()))
    torch.rand(5)  # the RNG moves on; restoring puts it back
    fresh = build(1, 5e-4)
    assert fresh.load_state_dict(load_checkpoint(tmp_path / "a.pt"), tmp_path / "a.pt") == []  # as many threads
    assert fresh.progress == saved.progress and fresh.loader.state == {"position": 7}
    assert fresh.hooks.state == {"gauge": {"mode": "correct"}}
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(), saved.model.state_dict().values()))
    assert torch.equal(fresh.optimizer.state_dict()["state"][0]["exp_avg"],
                       saved.optimizer.state_dict()["state"][0]["exp_avg"])
    assert fresh.optimizer.param_groups[0]["lr"] == 5e-4 and torch.equal(torch.get_rng_state(), rng)
    save_checkpoint(tmp_path / "w.pt", weights_checkpoint(saved.model, config, {"step": 3}))
    with pytest.raises(CheckpointError, match="of kind weights holds no training state"):
        fresh.load_state_dict(load_checkpoint(tmp_path / "w.pt"), tmp_path / "w.pt")


def test_a_target_is_reached_once_at_the_first_validation_at_or_below_it():
    progress = Progress(step=10, tokens=40, train_time_s=2.0, val_loss=3.5)
    assert not progress.reaches(0.0) and not progress.reaches(3.4)  # off; not yet
    assert progress.reaches(3.5) and progress.reached_target == {"step": 10, "train_time_s": 2.0, "tokens": 40,
                                                                 "val_loss": 3.5}
    progress.step, progress.val_loss = 20, 3.0
    assert not progress.reaches(3.5) and progress.reached_target["step"] == 10  # the first time only


def test_the_checksum_covers_every_entry_names_the_one_that_changed_and_survives_a_load_and_save(tmp_path):
    """Each entry has its own sha256 (each config section too): a tensor of the optimizer state, the loader's
    position and the attention path recorded in the config are each named when they change after the file was
    written; the tied names filled in on load do not count."""
    model = tiny_gpt(vocab_size=VOCAB, block_size=16, n_layer=1, n_embd=16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
    opt.step()
    state = {"model": model.state_dict(keep_vars=True), "optimizer": opt.state_dict(), "loader": {"batch": 3},
             "rng": {"torch": torch.get_rng_state(), "threads": 1}, "hooks": {}, "metrics": {"step": 1, "tokens": 4}}
    config = {**BARE_CONFIG, "attention": {"choice": "sdpa"}}
    save_checkpoint(tmp_path / "a.pt", training_checkpoint(config, state))
    raw = torch.load(tmp_path / "a.pt", weights_only=False)
    assert raw["tied"] == {"lm_head.weight": "transformer.wte.weight"} and "lm_head.weight" not in raw["model"]
    assert entry_checksums(raw) == raw["checksum"] and {"loader", "config.attention", "model"} <= set(raw["checksum"])
    loaded = load_checkpoint(tmp_path / "a.pt", verify=True)
    assert loaded["model"]["lm_head.weight"] is loaded["model"]["transformer.wte.weight"]  # filled in on load
    save_checkpoint(tmp_path / "b.pt", loaded)  # saved again: the same entries, the same checksums
    assert torch.load(tmp_path / "b.pt", weights_only=False)["checksum"] == raw["checksum"]
    changes = {"optimizer": lambda c: c["optimizer"]["state"][0]["exp_avg"].view(-1)[0].add_(1e-3),
               "loader": lambda c: c["loader"].update(batch=4),
               "config.attention": lambda c: c["config"]["attention"].update(choice="sdpb")}
    for entry, change in changes.items():
        damaged = torch.load(tmp_path / "a.pt", weights_only=False)
        change(damaged)
        torch.save(damaged, tmp_path / "c.pt")
        with pytest.raises(CheckpointError, match=f"c.pt: its {entry} entry does not match its checksum"):
            load_checkpoint(tmp_path / "c.pt", verify=True)


def test_a_v3_file_is_verified_by_its_tensor_checksum_and_read_as_today_s(tmp_path):
    """v3's checksum covered the tensors only: a changed tensor is refused, a changed config is not (v3 could not
    tell), and the file reads in today's format; v1 files from before checksums have nothing to verify."""
    model = train_gpt.GPT(train_gpt.GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=1, n_embd=8))
    v3 = weights_checkpoint(model, dict(BARE_CONFIG), {"step": 1})
    v3["format"] = "symgpt-checkpoint-v3"
    v3["checksum"] = tensor_checksum(v3)
    torch.save(v3, tmp_path / "v3.pt")
    assert load_checkpoint(tmp_path / "v3.pt", verify=True)["format"] == CHECKPOINT_FORMAT
    v3["config"]["preset"] = "smoke"
    torch.save(v3, tmp_path / "v3_config.pt")
    assert load_checkpoint(tmp_path / "v3_config.pt", verify=True)["config"]["preset"] == "smoke"
    v3["model"]["transformer.ln_f.weight"][0] += 1
    torch.save(v3, tmp_path / "v3_tensor.pt")
    with pytest.raises(CheckpointError, match="its tensors do not match the checksum"):
        load_checkpoint(tmp_path / "v3_tensor.pt", verify=True)
    v3["format"] = "symgpt-checkpoint-v1"  # a v1 file is verified before it is upgraded
    torch.save(v3, tmp_path / "v1.pt")
    with pytest.raises(CheckpointError, match="its tensors do not match the checksum"):
        load_checkpoint(tmp_path / "v1.pt", verify=True)
    del v3["checksum"]  # v1 files from before checksums: nothing to verify
    torch.save(v3, tmp_path / "v1_old.pt")
    assert load_checkpoint(tmp_path / "v1_old.pt", verify=True)["step"] == 1


# ----- where a process trains; how it stops; what it reports -----


@pytest.mark.parametrize("sequences, bound, world, layout", [
    (8, 8, 1, (8, 1)), (8, 8, 8, (1, 1)), (8, 8, 2, (4, 1)), (16, 8, 1, (8, 2)), (12, 8, 1, (6, 2)),
    (12, 5, 1, (4, 3)), (128, 8, 8, (8, 2)), (7, 8, 1, (7, 1)), (7, 4, 1, (1, 7)),
])
def test_batch_layout_picks_the_largest_micro_batch_that_splits(sequences, bound, world, layout):
    hp = train_gpt.TrainConfig(seq_len=64, batch_tokens=64 * sequences, micro_batch=bound)
    assert batch_layout(hp, world) == layout


def test_a_stop_request_on_one_process_is_the_signal_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest(world=1) as stop:
        assert stop.agreed() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_log_helpers_say_what_trackers_plot_and_how_long():
    assert record_numbers({"step": 3, "loss": 1.5, "tokens": 9, "summary": True, "note": "x"}) == {"loss": 1.5,
                                                                                                  "tokens": 9}
    assert format_duration(59.9) == "0m59s" and format_duration(3725) == "1h02m05s"


# ----- fileio: atomic writes, dead writers' temporaries, the lock of a run or grid directory -----


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.json"
    atomic_write(path, b"old")
    with pytest.raises(OSError, match="disk full"), atomic_writer(path) as f:
        f.write(b"new, half written")
        raise OSError("disk full")
    assert path.read_bytes() == b"old" and list(tmp_path.iterdir()) == [path]


def test_dead_temporaries_are_those_of_writers_that_no_longer_run(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"latest.pt.{ended.stdout.strip()}.tmp"
    live = tmp_path / f"latest.pt.{os.getppid()}.tmp"
    other = tmp_path / "notes.tmp"
    for path in (dead, live, other):
        path.write_text("x")
    assert dead_temporaries(tmp_path) == [dead]


def test_a_held_lock_names_its_holder_and_dies_with_it(tmp_path):
    lock = tmp_path / ".lock"
    assert lock_holder(lock) is None
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from fileio import hold_lock; "
                               f"held = hold_lock({str(lock)!r}, 'test holder'); print('held', flush=True); time.sleep(600)"],
                              env=ENV, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lock_holder(lock) == "test holder"
        with pytest.raises(LockHeldError) as refused:
            hold_lock(lock, "second")
        assert refused.value.holder == "test holder"
    finally:
        holder.kill()  # SIGKILL: no clean-up code runs
        holder.wait()
    assert lock_holder(lock) is None
    handle = hold_lock(lock, "this process")
    assert lock.read_text() == "this process\n"
    handle.close()


def test_a_v1_checkpoint_without_a_preset_takes_it_from_its_runs_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"preset": {"name": "smoke"}}))
    (tmp_path / "checkpoints").mkdir()
    old = {"format": "symgpt-checkpoint-v1", "step": 1, "model": {}, "config": {}}
    new = upgrade(old, tmp_path / "checkpoints" / "latest.pt", verify=False)
    assert new["config"]["preset"] == "smoke"
    assert json.loads((tmp_path / "config.json").read_text()) == {"preset": {"name": "smoke"}}
