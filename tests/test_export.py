"""Hugging Face export and import (docs/export.md#hugging-face): GELU models load as GPT2LMHeadModel and PReLU
models with AutoModelForCausalLM and the remote code written beside them, both with our mean-bias logits and greedy
text, offline and without this repository; the tokenizer is GPT-2's; GPT-2 directories import into our GPT, round
trips are bit-identical, the directory is as readable as the umask allows, and bad input gets a clear error."""
from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors", reason="the export writes safetensors (pip install safetensors)")

import export  # noqa: E402
import sample  # noqa: E402
import train_gpt  # noqa: E402
from data.shards import GPT2_VOCAB  # noqa: E402
from run.checkpoint import CheckpointError, save_checkpoint  # noqa: E402
from run.training_state import load_initial_weights  # noqa: E402
from tests.helpers import ROOT, repository_modules, tiny_gpt  # noqa: E402

pytestmark = pytest.mark.slow  # exports loaded by transformers, one in a fresh interpreter: ~12 s

TINY = dict(block_size=32, n_layer=2, n_head=2, n_embd=32)
BIAS_CASES = {
    "bqbv-shared": dict(bias_mode="bqbv", mean_q=0.5, mean_v=0.3),
    "bqbv-per-head": dict(bias_mode="bqbv", mean_q=0.5, mean_v=-0.2, bias_per_head=True),
    "bq-with-key-bias": dict(bias_mode="bq", mean_q=0.7, key_bias=True),
    "bv": dict(bias_mode="bv", mean_v=0.5),
    "learned-per-head": dict(bias_mode="learned", bias_per_head=True),
    "learned-shared": dict(bias_mode="learned"),
    "none": dict(bias_mode="none"),
}


def random_model(vocab_size: int = 50304, **overrides) -> train_gpt.GPT:
    """A tiny GPT whose every parameter (biases, LayerNorms, slopes) is perturbed away from its initialisation."""
    return tiny_gpt(noise=0.1, vocab_size=vocab_size, **{**TINY, **overrides}).eval()


def tokens(batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, GPT2_VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def our_logits(model: train_gpt.GPT, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx, biases=model.mean_biases, all_logits=True)[0][..., :GPT2_VOCAB]


@pytest.mark.parametrize("case", sorted(BIAS_CASES))
def test_gelu_export_loads_as_gpt2_with_our_logits(tmp_path, case):
    transformers = pytest.importorskip("transformers", reason="the GPT2LMHeadModel check needs transformers")
    model = random_model(activation="gelu", **BIAS_CASES[case])
    export.export_model(model, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.vocab_size == GPT2_VOCAB and hf.config.n_positions == TINY["block_size"]
    idx = tokens()
    with torch.no_grad():
        theirs = hf(idx).logits
    ours = our_logits(model, idx)
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_the_cut_vocabulary_lowers_the_loss_by_the_padding_mass_as_documented(tmp_path):
    """docs/export.md#what-the-conversion-does: the logits of real tokens are ours, but the exported softmax leaves
    out the 47 padding ids, so its loss on the same tokens is lower by the mean of -log(1 - p_pad)."""
    model = random_model()
    export.export_model(model, tmp_path / "hf")
    exported = export.load_exported(tmp_path / "hf")
    idx = tokens()
    with torch.no_grad():
        ours = model(idx[:, :-1], idx[:, 1:], biases=model.mean_biases)[1].item()
        theirs = exported(idx[:, :-1], idx[:, 1:])[1].item()
        logits = model(idx[:, :-1], biases=model.mean_biases, all_logits=True)[0].double()
    padding_mass = logits.softmax(-1)[..., GPT2_VOCAB:].sum(-1)
    assert ours - theirs == pytest.approx(-torch.log1p(-padding_mass).mean().item(), abs=5e-6)  # float32 losses
    assert ours - theirs > 1e-4  # 9.3e-4 here: about 47/50304 for an untrained head
    text = " ".join((ROOT / "docs" / "export.md").read_text().split())
    assert "its loss on the same tokens is lower than ours by the mean of −log(1 − p_pad)" in text


def test_bias_folding_is_needed(tmp_path):
    """The check above can fail: without folding the mean biases the exported logits differ."""
    model = random_model(activation="gelu", **BIAS_CASES["bqbv-shared"])
    state = export.hf_state_dict(model)
    unfolded = dict(state)
    unfolded["h.0.attn.c_attn.bias"] = model.transformer.h[0].attn.c_attn.bias.detach().clone()
    config = export.exported_model_config(model.config)
    idx = tokens()
    folded_logits = our_logits(export.model_from_hf_state_dict(state, config), idx)
    unfolded_logits = our_logits(export.model_from_hf_state_dict(unfolded, config), idx)
    torch.testing.assert_close(folded_logits, our_logits(model, idx), rtol=1e-5, atol=1e-5)
    assert (unfolded_logits - folded_logits).abs().max() > 1e-2


@pytest.mark.parametrize("case", sorted(BIAS_CASES))
def test_prelu_export_loads_with_auto_model_and_remote_code_with_our_logits(tmp_path, case):
    transformers = pytest.importorskip("transformers", reason="the AutoModelForCausalLM check needs transformers")
    model = random_model(activation="prelu", **BIAS_CASES[case])
    export.export_model(model, tmp_path / "prelu")
    meta = json.loads((tmp_path / "prelu" / "config.json").read_text())
    assert meta["model_type"] == "symgpt" and meta["activation_function"] == "prelu"
    assert meta["auto_map"]["AutoModelForCausalLM"] == "modeling_symgpt.SymGPTForCausalLM"
    assert (tmp_path / "prelu" / "modeling_symgpt.py").read_bytes() == export.MODELING_FILE.read_bytes()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prelu", trust_remote_code=True).eval()
    assert type(hf).__name__ == "SymGPTForCausalLM" and hf.config.vocab_size == GPT2_VOCAB
    idx = tokens()
    with torch.no_grad():
        theirs = hf(idx).logits
    torch.testing.assert_close(theirs, our_logits(model, idx), rtol=1e-5, atol=1e-5)
    loaded = export.load_exported(tmp_path / "prelu")  # and back into our GPT
    assert loaded.config.activation == "prelu" and loaded.config.bias_mode == "none"
    torch.testing.assert_close(our_logits(loaded, idx), our_logits(model, idx), rtol=1e-5, atol=1e-5)


def test_the_remote_codes_prelu_is_the_trainers(tmp_path):
    """modeling_symgpt.py, which an exported directory loads without this project, keeps its own copy of
    train_gpt.FeaturePReLU: the two class definitions are the same code (docstrings aside), and a state dict moves
    from one to the other with the same outputs."""
    def definition(path) -> str:
        [cls] = [node for node in ast.parse(path.read_text()).body
                 if isinstance(node, ast.ClassDef) and node.name == "FeaturePReLU"]
        if ast.get_docstring(cls) is not None:
            cls.body = cls.body[1:]
        return ast.dump(cls)

    assert definition(ROOT / "train_gpt.py") == definition(export.MODELING_FILE)
    pytest.importorskip("transformers", reason="modeling_symgpt imports transformers")
    sys.path.insert(0, str(ROOT))
    modeling_symgpt = importlib.import_module("modeling_symgpt")
    ours, theirs = train_gpt.FeaturePReLU(6), modeling_symgpt.FeaturePReLU(6)
    ours.weight.data.normal_(generator=torch.Generator().manual_seed(0))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours(x), theirs(x)) and not torch.equal(ours(x), torch.relu(x))


def test_the_prelu_slopes_are_per_feature_and_needed(tmp_path):
    """The check above can fail: GPT-2's own one-slope PReLU (what the config alone would build) or GELU in place of
    the per-feature slopes give other logits."""
    transformers = pytest.importorskip("transformers", reason="builds GPT-2 models with transformers")
    model = random_model(activation="prelu")
    export.export_model(model, tmp_path / "prelu")
    state = export.hf_state_dict(model)
    assert state["h.0.mlp.act.weight"].shape == (4 * TINY["n_embd"],)
    idx = tokens()
    for activation in ("prelu", "gelu"):
        config = transformers.GPT2Config(**{**json.loads((tmp_path / "prelu" / "config.json").read_text()),
                                            "activation_function": activation, "model_type": "gpt2"})
        stock = transformers.GPT2LMHeadModel(config).eval()
        stock.load_state_dict({k: v for k, v in state.items() if ".mlp.act." not in k}, strict=False)
        with torch.no_grad():
            assert (stock(idx).logits - our_logits(model, idx)).abs().max() > 1e-3, activation


def test_gelu_export_is_stock_gpt2_without_remote_code(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the AutoModelForCausalLM check needs transformers")
    export.export_model(random_model(activation="gelu"), tmp_path / "gelu")
    assert not (tmp_path / "gelu" / "modeling_symgpt.py").exists()
    meta = json.loads((tmp_path / "gelu" / "config.json").read_text())
    assert meta["model_type"] == "gpt2" and "auto_map" not in meta
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gelu")) is transformers.GPT2LMHeadModel


@pytest.fixture
def gpt2_ranks() -> None:
    """The GPT-2 BPE ranks in the local cache, from which the export writes the tokenizer (fetched if absent, as
    every tokenizer test does)."""
    from data.tokenizer import gpt2_tokenizer

    gpt2_tokenizer()


def test_the_exported_tokenizer_is_gpt2s(tmp_path, gpt2_ranks):
    transformers = pytest.importorskip("transformers", reason="loads the tokenizer with transformers")
    from data.tokenizer import gpt2_tokenizer

    export.export_model(random_model(activation="prelu"), tmp_path / "prelu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "prelu", trust_remote_code=True)
    ours = gpt2_tokenizer()
    text = ("Hello world!  Two  spaces, tabs\t\tand\nnew lines\n\n<|endoftext|>naïve café, 日本語, emoji 🤖, "
            "numbers 1234567 and don't stop; SHOUTING ÀÉÎ.")
    ids = tokenizer(text)["input_ids"]
    assert ids == ours.encode(text, allowed_special={"<|endoftext|>"}) and len(ids) > 40
    assert tokenizer.decode(ids) == text and tokenizer.eos_token_id == GPT2_VOCAB - 1
    assert json.loads((tmp_path / "prelu" / "generation_config.json").read_text()) == {
        "do_sample": True, "temperature": 0.8, "top_k": 200, "bos_token_id": 50256, "eos_token_id": 50256,
        "pad_token_id": 50256}


STANDALONE = """
import json, sys
for name in %r:
    sys.modules[name] = None  # nothing of the repository can be imported here
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
results = {}
for directory in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    ids = tokenizer("The cat", return_tensors="pt")["input_ids"]
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, ids.size(1):].tolist()
    generator = pipeline("text-generation", model=directory, trust_remote_code=True)
    text = generator("The cat", max_new_tokens=6, min_new_tokens=6, do_sample=False, return_full_text=False)
    results[directory] = {"greedy": greedy, "pipeline": text[0]["generated_text"]}
print(json.dumps(results))
""" % sorted({module.split(".")[0] for module in repository_modules()})


def test_exports_load_offline_without_this_repository_and_generate_as_sample_does(tmp_path, gpt2_ranks):
    """A fresh interpreter outside the repository, offline: AutoModelForCausalLM, AutoTokenizer and the
    text-generation pipeline; their greedy text equals `python -m sample --temperature 0`."""
    pytest.importorskip("transformers", reason="loads the exports with transformers")
    models = {act: random_model(activation=act, **BIAS_CASES["bqbv-shared"]) for act in ("prelu", "gelu")}
    for act, model in models.items():
        export.export_model(model, tmp_path / act)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    proc = subprocess.run([sys.executable, "-c", STANDALONE, *(str(tmp_path / act) for act in models)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    from data.tokenizer import gpt2_tokenizer

    for act, model in models.items():
        texts = sample.main(["--checkpoint", str(tmp_path / act), "--prompt", "The cat", "--max-new-tokens", "6",
                             "--temperature", "0"])
        result = results[str(tmp_path / act)]
        assert result["pipeline"] == texts[0] and gpt2_tokenizer().decode(result["greedy"]) == texts[0], act
        prompt = torch.tensor([gpt2_tokenizer().encode("The cat")])
        assert result["greedy"] == sample.generate(model, prompt, 6, temperature=0,
                                                   vocab_limit=GPT2_VOCAB)[0, 2:].tolist()


@pytest.mark.parametrize("activation", ["prelu", "gelu"])
def test_export_from_hf_export_is_bit_identical(tmp_path, activation, gpt2_ranks):
    """to-hf, from-hf into a checkpoint, to-hf again: every file of the two directories is byte for byte the same."""
    model = random_model(activation=activation, **BIAS_CASES["learned-per-head"])
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    save_checkpoint(tmp_path / "run" / "checkpoints" / "latest.pt", export.checkpoint_of(model, "test"))
    export.main(["to-hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "first")])
    export.main(["from-hf", "--source", str(tmp_path / "first"), "--out", str(tmp_path / "back.pt")])
    export.main(["to-hf", "--run", str(tmp_path / "back.pt"), "--out", str(tmp_path / "second")])
    names = sorted(p.name for p in (tmp_path / "first").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "second").iterdir()) and "model.safetensors" in names
    for name in names:
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), name
    export.main(["to-hf", "--checkpoint", str(tmp_path / "second"), "--out", str(tmp_path / "third")])  # a directory
    assert (tmp_path / "third" / "model.safetensors").read_bytes() == (tmp_path / "first" / "model.safetensors"
                                                                         ).read_bytes()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_exported_directory_respects_the_umask(tmp_path, umask, gpt2_ranks):
    previous = os.umask(umask)
    try:
        export.export_model(random_model(activation="prelu"), tmp_path / "out")
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
    files = list((tmp_path / "out").iterdir())
    assert len(files) == 7 and {f.stat().st_mode & 0o777 for f in files} == {0o666 & ~umask}


def test_without_local_ranks_the_export_notes_the_missing_tokenizer(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SYMGPT_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_tiktoken"))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    save_checkpoint(tmp_path / "run" / "checkpoints" / "latest.pt",
                         export.checkpoint_of(random_model(activation="gelu"), "test"))
    export.main(["to-hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    assert "no tokenizer written: the GPT-2 BPE ranks are not in the local cache" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "generation_config.json",
                                                                    "model.safetensors"]


@pytest.mark.parametrize("activation", ["gelu", "gelu_new"])
def test_gpt2_directory_imports_with_the_same_logits(tmp_path, activation):
    transformers = pytest.importorskip("transformers", reason="builds a GPT-2 directory with transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=GPT2_VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     activation_function=activation, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "gpt2")
    ours = export.load_exported(tmp_path / "gpt2")
    idx = tokens()
    with torch.no_grad():
        theirs = hf(idx).logits
    if activation == "gelu":
        torch.testing.assert_close(our_logits(ours, idx), theirs, rtol=1e-5, atol=1e-5)
    else:  # the tanh approximation of GELU: our exact GELU differs a little, and the importer says so
        assert (our_logits(ours, idx) - theirs).abs().max() < 5e-2


def test_round_trip_keeps_every_tensor(tmp_path):
    model = random_model(activation="gelu", **BIAS_CASES["bqbv-per-head"])
    export.export_model(model, tmp_path / "a")
    export.export_model(export.load_exported(tmp_path / "a"), tmp_path / "b")
    from safetensors.torch import load_file

    first, second = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert first["wte.weight"].shape == (GPT2_VOCAB, TINY["n_embd"])
    assert first["h.0.attn.c_attn.weight"].shape == (TINY["n_embd"], 3 * TINY["n_embd"])  # Conv1D: (in, out)


def test_cli_exports_a_run_and_imports_it_back_as_a_checkpoint(tmp_path, capsys):
    model = random_model(activation="gelu", **BIAS_CASES["bqbv-shared"])
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    save_checkpoint(tmp_path / "run" / "checkpoints" / "latest.pt", export.checkpoint_of(model, "test"))
    export.main(["to-hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    export.main(["from-hf", "--source", str(tmp_path / "hf"), "--out", str(tmp_path / "imported.pt")])
    assert 'GPT2LMHeadModel.from_pretrained("' in capsys.readouterr().out
    imported = train_gpt.model_from_checkpoint(tmp_path / "imported.pt")
    idx = tokens()
    torch.testing.assert_close(our_logits(imported, idx), our_logits(model, idx), rtol=1e-5, atol=1e-5)
    texts = sample.main(["--checkpoint", str(tmp_path / "imported.pt"), "--max-new-tokens", "3", "--seed", "1"])
    assert len(texts) == 1


def test_errors_name_the_problem(tmp_path):
    model = random_model(activation="gelu")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "other.txt").write_text("keep me")
    with pytest.raises(export.ExportError, match="exists and is not empty"):
        export.export_model(model, tmp_path / "full")
    assert (tmp_path / "full" / "other.txt").read_text() == "keep me"
    with pytest.raises(export.ExportError, match="--out .*other.txt is a file; to-hf writes a directory"):
        export.export_model(model, tmp_path / "full" / "other.txt")
    assert (tmp_path / "full" / "other.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    with pytest.raises(export.ExportError, match="not a directory holding config.json"):
        export.load_exported(tmp_path / "missing")
    with pytest.raises(export.ExportError, match="no config.json"):
        export.load_exported(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"")
    with pytest.raises(export.ExportError, match="neither a GPT-2 config"):
        export.load_exported(tmp_path / "empty")
    with pytest.raises(SystemExit, match="--checkpoint: no checkpoint at .* or a directory written by"):
        export.main(["to-hf", "--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "x")])
    with pytest.raises(export.ExportError, match="does not fit|shape"):
        state = export.hf_state_dict(model)
        export.model_from_hf_state_dict(state, train_gpt.GPTConfig(**{**TINY, "n_embd": 64, "n_head": 2,
                                                                      "activation": "gelu", "bias_mode": "none"}))
    assert not list(tmp_path.glob(".x.*")) and not list(tmp_path.glob(".full.*"))


@pytest.fixture
def imported_gpt2(tmp_path) -> tuple[str, train_gpt.GPT]:
    """A GPT-2 directory (GELU, vocab 50257, 64 positions) converted by `export from-hf` into our checkpoint."""
    model = random_model(vocab_size=GPT2_VOCAB, activation="gelu", bias_mode="none", block_size=64)
    export.export_model(model, tmp_path / "gpt2")
    export.main(["from-hf", "--source", str(tmp_path / "gpt2"), "--out", str(tmp_path / "gpt2.pt")])
    return str(tmp_path / "gpt2.pt"), model


def test_init_from_copies_the_weights_and_adapts_vocabulary_positions_and_biases(imported_gpt2):
    path, source = imported_gpt2
    target = tiny_gpt(3, vocab_size=50304, block_size=16, activation="gelu", bias_mode="learned")
    fresh_rows = target.transformer.wte.weight[GPT2_VOCAB:].detach().clone()
    note = load_initial_weights(target, path)
    assert "vocabulary 50257 -> 50304" in note and "positions 64 -> 16" in note and "bias mode none -> learned" in note
    wte = target.transformer.wte.weight.detach()
    assert torch.equal(wte[:GPT2_VOCAB], source.transformer.wte.weight.detach())
    assert torch.equal(wte[GPT2_VOCAB:], fresh_rows)
    assert target.lm_head.weight is target.transformer.wte.weight
    assert torch.equal(target.transformer.wpe.weight.detach(), source.transformer.wpe.weight.detach()[:16])
    for name, tensor in source.state_dict().items():
        if "wte" not in name and "wpe" not in name and "lm_head" not in name:
            assert torch.equal(target.state_dict()[name], tensor), name
    wider = tiny_gpt(vocab_size=50304, n_embd=64, activation="gelu")
    with pytest.raises(CheckpointError, match="--n-embd 32, this run 64; set --n-embd 32"):
        load_initial_weights(wider, path)
    longer = tiny_gpt(vocab_size=50304, block_size=128, activation="gelu")
    with pytest.raises(CheckpointError, match="--block-size 64, this run 128"):
        load_initial_weights(longer, path)


def test_trainer_starts_from_init_from_weights(imported_gpt2, tmp_path, capsys):
    from data.shards import write_shard

    path, _ = imported_gpt2
    write_shard(tmp_path / "tok_000000.bin", np.random.default_rng(0).integers(0, 500, 4096).astype(np.uint16))
    args = ["--train-files", str(tmp_path / "tok_*.bin"), "--n-layer", "2", "--n-head", "2", "--n-embd", "32",
            "--block-size", "32", "--seq-len", "32", "--batch-tokens", "128", "--micro-batch", "4", "--steps", "1",
            "--val-every", "0", "--val-tokens", "256", "--activation", "gelu", "--device", "cpu",
            "--run-dir", str(tmp_path / "runs"), "--run-name", "finetune"]
    train_gpt.main([*args, "--init-from", path])
    assert f"initial weights from {path}" in (tmp_path / "runs" / "finetune" / "log.txt").read_text()
    with pytest.raises(SystemExit):
        train_gpt.main([*args[:-1], "other", "--init-from", str(tmp_path / "missing.pt")])
    assert "--init-from: no checkpoint at" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_gpt.main(["--resume", path])
    assert f"start a new run from them with --init-from {path}" in capsys.readouterr().err


def test_small_vocabulary_exports_without_gpt2_special_tokens(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the GPT2LMHeadModel check needs transformers")
    model = random_model(vocab_size=128, activation="gelu", bias_mode="bqbv")
    export.export_model(model, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx, all_logits=True)[0], rtol=1e-5, atol=1e-5)
    assert "eos_token_id" not in json.loads((tmp_path / "hf" / "config.json").read_text())


@pytest.mark.parametrize("overrides, message", [
    (dict(objective="mlm"), "--objective mlm: a masked LM attends in both directions"),
    (dict(attention="relational", bias_mode="none"), "--attention relational: relational attention .* has no GPT-2 "
                                                     "layout"),
])
def test_models_without_gpt2_layout_are_refused(tmp_path, overrides, message):
    with pytest.raises(export.ExportError, match=message):
        export.export_model(random_model(**overrides), tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def gpt2_directory(tmp_path) -> str:
    export.export_model(random_model(activation="gelu"), tmp_path / "hf")
    return str(tmp_path / "hf")


def edit_config(directory, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]),
     r"hf/model.safetensors: not a readable safetensors file .* truncated or damaged"),
    (lambda d: (d / "config.json").write_text('{"model_type": "gpt2", '), r"hf/config.json: not a JSON config"),
    (lambda d: (d / "config.json").write_bytes(b"\xff\xfe{}"), r"hf/config.json: not a JSON config"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), r"hf/config.json: holds a JSON list"),
    (lambda d: edit_config(d, n_head=0), r"hf/config.json: n_head = 0; a GPT-2 needs a positive integer"),
    (lambda d: edit_config(d, n_layer="2"), r"hf/config.json: n_layer = '2'; a GPT-2 needs a positive integer"),
    (lambda d: edit_config(d, n_head=3), r"hf/config.json: n_embd = 32 does not split into n_head = 3 heads"),
])
def test_from_hf_names_a_damaged_file(tmp_path, damage, message):
    source = gpt2_directory(tmp_path)
    damage(tmp_path / "hf")
    with pytest.raises(SystemExit, match=message):
        export.main(["from-hf", "--source", source, "--out", str(tmp_path / "x.pt")])
    assert not (tmp_path / "x.pt").exists()


def test_checkpoint_and_run_are_one_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        export.main(["to-hf", "--run", "a", "--checkpoint", "b", "--out", str(tmp_path / "x")])
    assert "--checkpoint / --run given twice" in capsys.readouterr().err


def test_a_config_without_activation_function_is_read_as_gpt2s_default_and_says_so(tmp_path, capsys):
    export.export_model(random_model(activation="gelu"), tmp_path / "gelu")
    meta = json.loads((tmp_path / "gelu" / "config.json").read_text())
    del meta["activation_function"]  # transformers' GPT2Config then means gelu_new, the tanh approximation
    (tmp_path / "gelu" / "config.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert export.load_exported(tmp_path / "gelu").config.activation == "gelu"
    assert "'gelu_new' (the tanh approximation of GELU)" in capsys.readouterr().err
