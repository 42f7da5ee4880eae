"""What every reader of a checkpoint (--resume, --init-from, sample, eval.*, export to-hf) does with a file it cannot
use, and what it replays of the run (docs/runs.md#checkpoints): an older file lacking an entry, a configuration no
model can be built with, weights that hold NaN, a kind that holds no training state, and the attention path the run
recorded."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import export
import sample
import train_gpt
from eval import val_loss
from eval.target import load_target_checkpoint
from kernels import attention_paths
from run.checkpoint import TRAINING, WEIGHTS, load_checkpoint, save_checkpoint
from tests.helpers import tiny_args, tiny_gpt, write_v1_checkpoint


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """The latest.pt of a 2-step tiny run."""
    root = tmp_path_factory.mktemp("trained")
    train_gpt.main(tiny_args(corpus, root, "run", steps=2, **{"val-every": 0}))
    return root / "run" / "checkpoints" / "latest.pt"


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A checkpoint of kind weights of a small GPT with GPT-2's vocabulary (so that `sample` can encode text)."""
    model = tiny_gpt(0, vocab_size=50304)
    path = tmp_path_factory.mktemp("weights") / "model.pt"
    save_checkpoint(path, export.checkpoint_of(model, "test"))
    return path


def altered(source: Path, target: Path, change, checksummed: bool = True) -> Path:
    """`source` with `change(checkpoint)` applied, written to `target` with a checksum over the change (what a
    writer of such a file would leave: the checksum then says nothing, the reader's own checks must), or as it was
    (an older format, whose checksum covers tensors only)."""
    ckpt = torch.load(source, weights_only=False)
    change(ckpt)
    if checksummed:
        save_checkpoint(target, ckpt)
    else:
        torch.save(ckpt, target)
    return target


def val_loss_args(path: Path, corpus: Path) -> list[str]:
    return ["--checkpoint", str(path), "--val-files", str(corpus / "syn_val_*.bin"), "--val-tokens", "256",
            "--seq-len", "32", "--micro-batch", "4", "--out", str(path.parent / "eval")]


def test_a_training_run_writes_kind_training_and_from_hf_kind_weights(trained, weights):
    assert load_checkpoint(trained)["kind"] == TRAINING and load_checkpoint(weights)["kind"] == WEIGHTS


def test_resuming_a_weights_checkpoint_is_refused_naming_its_kind(weights, capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--resume", str(weights)])
    assert f"a checkpoint of kind weights (model weights, no training state); start a new run from them with " \
           f"--init-from {weights}" in capsys.readouterr().err


def test_a_v1_file_lacking_an_entry_is_refused_in_one_line_naming_it(trained, tmp_path, capsys):
    """v1 goes through the one upgrade, then the same check as today's files: no KeyError from --resume or sample."""
    write_v1_checkpoint(trained, tmp_path / "v1.pt")
    no_step = altered(tmp_path / "v1.pt", tmp_path / "v1_nostep.pt", lambda ckpt: ckpt.pop("step"), False)
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--resume", str(no_step)])
    err = capsys.readouterr().err
    assert f"{no_step}: a symgpt-checkpoint-v1 checkpoint without step;" in err and len(err.splitlines()) == 1
    no_model = altered(tmp_path / "v1.pt", tmp_path / "v1_nomodel.pt", lambda ckpt: ckpt["config"].pop("model"),
                       False)
    with pytest.raises(SystemExit, match=r"v1_nomodel.pt: a symgpt-checkpoint-v1 checkpoint without config.model;"):
        sample.main(["--checkpoint", str(no_model), "--max-new-tokens", "1"])


def test_a_model_configuration_that_builds_no_model_is_refused_by_every_reader(trained, weights, corpus, tmp_path,
                                                                             capsys):
    """n_head 0 (a checksummed file, its configuration altered): one line naming the file and the value, never a
    ZeroDivisionError inside the model."""
    def no_heads(ckpt):
        ckpt["config"]["model"]["n_head"] = 0

    problem = "its model configuration builds no model (--n-head must be > 0, got 0)"
    bad_run = altered(trained, tmp_path / "run.pt", no_heads)
    for argv in (["--resume", str(bad_run)], tiny_args(corpus, tmp_path, "new", **{"init-from": str(bad_run)})):
        with pytest.raises(SystemExit):
            train_gpt.parse_config(argv)
        assert f"{bad_run}: {problem}" in capsys.readouterr().err
    bad = altered(weights, tmp_path / "weights.pt", no_heads)
    readers = [lambda: sample.main(["--checkpoint", str(bad), "--max-new-tokens", "1"]),
               lambda: val_loss.main(val_loss_args(bad, corpus)),
               lambda: export.main(["to-hf", "--checkpoint", str(bad), "--out", str(tmp_path / "hf")])]
    for read in readers:
        with pytest.raises(SystemExit, match=f"error: {bad}: {problem}".replace("(", r"\(").replace(")", r"\)")):
            read()
    odd = altered(weights, tmp_path / "odd.pt", lambda ckpt: ckpt["config"]["model"].update(n_embd=33))
    with pytest.raises(SystemExit, match=r"--n-embd 33 must be divisible by --n-head 2"):
        export.main(["to-hf", "--checkpoint", str(odd), "--out", str(tmp_path / "hf")])


def test_weights_holding_nan_warn_in_sample_and_fail_the_evaluation(weights, corpus, tmp_path, capsys):
    """NaN in a padded vocabulary row (an id no text holds): sample writes text, warned; NaN that reaches every
    token's probabilities: one line instead of torch's error. The evaluation refuses either, naming the tensor."""
    for row, name in ((50300, "transformer.wte.weight"), (None, "transformer.h.1.mlp.c_fc.weight")):
        ckpt = load_checkpoint(weights)
        ckpt["model"][name][row or 0, 0] = float("nan")
        path = tmp_path / f"nan{row}.pt"
        save_checkpoint(path, ckpt)  # a valid checksum over the NaN
        load_checkpoint(path, verify=True)
        if row:
            assert sample.main(["--checkpoint", str(path), "--max-new-tokens", "2"])
        else:
            with pytest.raises(SystemExit, match="reach the next token's probabilities: no text can be sampled"):
                sample.main(["--checkpoint", str(path), "--max-new-tokens", "2"])
        err = capsys.readouterr().err
        assert f"warning: {path}: the weights hold NaN or infinite values ({name}" in err
        with pytest.raises(SystemExit, match=rf"{path.name}: the weights hold NaN or infinite values \({name}"):
            val_loss.main(val_loss_args(path, corpus))


def test_weights_holding_nan_are_not_exported_nor_started_from(weights, corpus, tmp_path, capsys):
    """A diverged run's weights (a file from elsewhere, checksummed): export to-hf and --init-from refuse them in one
    line naming the tensor, instead of writing a NaN model or blaming the learning rate of the run they start."""
    ckpt = load_checkpoint(weights)
    ckpt["model"]["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
    path = tmp_path / "nan.pt"
    save_checkpoint(path, ckpt)
    with pytest.raises(SystemExit, match=r"the weights hold NaN or infinite values \(transformer.h.0.mlp.c_fc.weight\)"
                                         ": the run had diverged; export a checkpoint of an earlier step"):
        export.main(["to-hf", "--checkpoint", str(path), "--out", str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()
    with pytest.raises(SystemExit):
        train_gpt.parse_config(tiny_args(corpus, tmp_path, "from_nan", **{"init-from": str(path),
                                                                          "vocab-size": 50304}))
    err = capsys.readouterr().err
    assert f"--init-from {path}: the weights hold NaN or infinite values" in err and "--lr" not in err, err


# Damage to entries that are not tensors, in the two ways it comes: written after the checksum (a copy, a bit
# flipped: the checksum names the entry) and written with a checksum over it (a file not from train_gpt.py: the
# entry's shape or value is refused, named). Each: (entry named, the change).
AFTER_THE_CHECKSUM = {
    "loader": lambda ckpt: ckpt["loader"].update(batch=ckpt["loader"]["batch"] + 7),
    "config.attention": lambda ckpt: ckpt["config"]["attention"].update(choice="flex"),
    "step": lambda ckpt: ckpt.update(step=ckpt["step"] + 1),
    "metrics": lambda ckpt: ckpt["metrics"].update(val_loss=1.0),
}
WITH_A_CHECKSUM = {
    "step": lambda ckpt: ckpt.update(step="x"),
    "tied": lambda ckpt: ckpt.update(tied={"lm_head.weight": "nowhere"}),
    "metrics": lambda ckpt: ckpt["metrics"].update(tokens="x"),
    "config.optim": lambda ckpt: ckpt["config"]["optim"].update(lr="x"),
    "config.attention": lambda ckpt: ckpt["config"]["attention"].update(choice="sdpb"),
    "hooks": lambda ckpt: ckpt.update(hooks=[1]),
}


def every_reader(path: Path, corpus: Path, tmp_path: Path) -> dict:
    init_from = tiny_args(corpus, tmp_path, "init", **{"init-from": str(path)})
    return {"--resume": lambda: train_gpt.parse_config(["--resume", str(path)]),
            "--init-from": lambda: train_gpt.parse_config(init_from),
            "sample": lambda: sample.main(["--checkpoint", str(path), "--max-new-tokens", "1"]),
            "eval.val_loss": lambda: val_loss.main(val_loss_args(path, corpus)),
            "export to-hf": lambda: export.main(["to-hf", "--checkpoint", str(path), "--out", str(tmp_path / "hf")])}


@pytest.mark.parametrize("entry, change, checksummed",
                         [(entry, change, False) for entry, change in AFTER_THE_CHECKSUM.items()]
                         + [(entry, change, True) for entry, change in WITH_A_CHECKSUM.items()])
def test_every_reader_refuses_a_damaged_entry_in_one_line_naming_it(trained, corpus, tmp_path, capsys, entry, change,
                                                                    checksummed):
    path = altered(trained, tmp_path / "damaged.pt", change, checksummed)
    for reader, read in every_reader(path, corpus, tmp_path).items():
        with pytest.raises(SystemExit) as refused:
            read()
        message = str(refused.value.code) if isinstance(refused.value.code, str) else capsys.readouterr().err
        assert message.count("\n") <= 1 and f"{path}: its {entry} entry " in message, f"{reader}: {message}"
    assert not (tmp_path / "hf").exists()


def test_one_attention_default_a_models_and_autos_where_no_row_is():
    model = tiny_gpt(block_size=16, n_layer=1)
    auto = attention_paths.choose("auto", torch.device("cpu"), torch.float32, 16, compiled=False)
    assert model.transformer.h[0].attn.attention_impl == attention_paths.DEFAULT_IMPLEMENTATION == auto["choice"]


def test_every_reader_replays_the_attention_path_the_run_recorded(trained, weights, tmp_path):
    """The run's choice is in its checkpoints as in config.json; eval, sample and export build the model on it. A
    checkpoint that records none (an import from Hugging Face, a v2 file) gives the default."""
    recorded = load_checkpoint(trained)["config"]["attention"]
    assert recorded["choice"] == "sdpa" and recorded["requested"] == "auto"  # a CPU run: no row for it

    def paths(model: train_gpt.GPT) -> set[str]:
        return {block.attn.attention_impl for block in model.transformer.h}

    flex = {"requested": "flex", "choice": "flex", "source": "--attention-impl"}
    chose_flex = altered(trained, tmp_path / "flex.pt", lambda ckpt: ckpt["config"].update(attention=flex))
    assert paths(export.load_model(chose_flex)) == {"flex"}  # sample, export to-hf
    assert paths(train_gpt.model_from_checkpoint(load_target_checkpoint(chose_flex))) == {"flex"}  # eval.*
    assert paths(train_gpt.model_from_checkpoint(chose_flex)) == {"flex"}
    assert paths(export.load_model(weights)) == {attention_paths.DEFAULT_IMPLEMENTATION}
