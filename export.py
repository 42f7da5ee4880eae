"""Take models elsewhere: our checkpoints to Hugging Face directories, and GPT-2 weights into our checkpoints
(docs/export.md#hugging-face).

    python -m export to-hf --checkpoint RUN_FILE_OR_DIR --out DIR    # GELU: GPT-2; PReLU: GPT-2 + remote code
    python -m export from-hf --source DIR_OR_HUB_ID --out FILE.pt    # e.g. the original GPT-2 124M ("gpt2")

Both directions use GPT-2's tensor layout and names (Conv1D weights stored (in, out), the transpose of our
nn.Linear). The symmetry-breaking biases are folded into c_attn's bias with their evaluation values: the query
part gains E[b_Q] (q + E[b_Q] = xA_Q + (c_Q + E[b_Q])), the value part E[b_V] (exact, since softmax rows sum to 1),
and a learned model's b_q, b_v (b_K, which changes no output, is never added). The exported model therefore has plain
biases and matches our logits with the mean biases. The vocabulary is cut to GPT-2's 50257 tokens: our padded
rows are never real tokens, and the logits of every real token stay the same.

A GELU model is a stock GPT2LMHeadModel directory. Stock GPT-2 has no PReLU: a PReLU model is written in the
same layout plus one slope vector per block (`h.N.mlp.act.weight`), with config model_type "symgpt" whose auto_map
names the classes of modeling_symgpt.py, copied beside the weights (transformers' convention for architectures of
its own: `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`). Every directory also holds the
GPT-2 tokenizer (vocab.json, merges.txt) and generation_config.json with sample's defaults. `load_exported` (or
`from-hf`) reads any of them back into our GPT. --checkpoint, here and in sample and the evaluations, takes a run
directory, a checkpoint file or such a directory (`model_file`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import train_gpt
from cli import ArgumentParser, add_model_flag
from config import read_checkpoint
from data.shards import EOT_TOKEN, GPT2_VOCAB
from data.tokenizer import ENDOFTEXT, gpt2_bpe_files
from fileio import atomic_write, doing, exits_on_filesystem_errors, make_directory
from optim import OPTIMIZERS
from run.checkpoint import (CheckpointError, non_finite_weights, resolve_checkpoint_path, save_checkpoint,
                            weights_checkpoint)
from variants import ResearchConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
MODELING_FILE = Path(__file__).with_name("modeling_symgpt.py")  # the remote code of PReLU exports
MODEL_TYPE = "symgpt"
AUTO_MAP = {"AutoConfig": "modeling_symgpt.SymGPTConfig", "AutoModelForCausalLM": "modeling_symgpt.SymGPTForCausalLM"}
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 200}  # python -m sample's, also generation_config.json's
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which our model uses
HF_DEFAULT_ACTIVATION = "gelu_new"  # transformers' GPT2Config default, for configs that do not name one
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
IGNORED_HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in older GPT-2 files


class ExportError(ValueError):
    """A model or directory that cannot be converted, with what to do instead."""


def hf_state_dict(model: train_gpt.GPT) -> dict[str, torch.Tensor]:
    """Our model's weights under GPT-2's names and layout (no `transformer.` prefix, as GPT-2's own files; the tied
    lm_head is not stored), with the evaluation biases folded into c_attn.bias and the vocabulary cut to GPT-2's."""
    cfg = model.config
    C, vocab = cfg.n_embd, min(cfg.vocab_size, GPT2_VOCAB)
    out = {}
    for name, tensor in model.state_dict().items():
        if not name.startswith("transformer."):
            continue  # lm_head.weight: tied to wte
        key = name.removeprefix("transformer.")
        if key.endswith(("attn.b_q", "attn.b_v")):
            continue  # folded below
        tensor = tensor.detach().float()
        if key == "wte.weight":
            tensor = tensor[:vocab]
        elif key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        out[key] = tensor.contiguous().clone()
    use_q, use_v = cfg.sampled_biases
    for i, block in enumerate(model.transformer.h):  # the query and value biases evaluation adds, where it adds any
        if cfg.bias_mode == "learned":
            b_q, b_v = block.attn.b_q.detach(), block.attn.b_v.detach()
        else:
            b_q = model.mean_biases[i, 0] if use_q else None
            b_v = model.mean_biases[i, 1] if use_v else None
        bias = out[f"h.{i}.attn.c_attn.bias"]
        for b, part in ((b_q, slice(0, C)), (b_v, slice(2 * C, 3 * C))):
            if b is not None:  # one (d,) row per head, or one shared by the heads
                bias[part] += b.expand(cfg.n_head, cfg.head_dim).reshape(C).float()
    return out


def exported_model_config(config: train_gpt.GPTConfig) -> train_gpt.GPTConfig:
    """The config of the exported model read back into our GPT: biases folded (bias_mode none), vocabulary cut."""
    return dataclasses.replace(config, bias_mode="none", key_bias=False,
                               vocab_size=min(config.vocab_size, GPT2_VOCAB))


def hf_config(config: train_gpt.GPTConfig) -> dict:
    """transformers' config.json for the exported model: a GPT2Config for GELU (exact-erf GELU), our SymGPTConfig
    with its auto_map for PReLU; no dropout, tied embeddings, and <|endoftext|> as BOS/EOS when the vocabulary is
    GPT-2's."""
    vocab = min(config.vocab_size, GPT2_VOCAB)
    special = {"bos_token_id": EOT_TOKEN, "eos_token_id": EOT_TOKEN} if vocab == GPT2_VOCAB else {}
    kind = ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"} if config.activation == "gelu" else
            {"architectures": ["SymGPTForCausalLM"], "model_type": MODEL_TYPE, "auto_map": AUTO_MAP})
    return {
        **kind, "vocab_size": vocab, "n_positions": config.block_size, "n_embd": config.n_embd,
        "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": 4 * config.n_embd,
        "activation_function": config.activation, "layer_norm_epsilon": LAYER_NORM_EPS, "initializer_range": 0.02,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "tie_word_embeddings": True, **special,
    }


def generation_config(config: train_gpt.GPTConfig) -> dict:
    """generation_config.json: `python -m sample`'s sampling defaults (SAMPLING_DEFAULTS) and, for GPT-2's
    vocabulary, <|endoftext|> as BOS, EOS and padding."""
    special = ({"bos_token_id": EOT_TOKEN, "eos_token_id": EOT_TOKEN, "pad_token_id": EOT_TOKEN}
               if config.vocab_size >= GPT2_VOCAB else {})
    return {"do_sample": True, **SAMPLING_DEFAULTS, **special}


def write_tokenizer(out_dir: Path, config: train_gpt.GPTConfig) -> str | None:
    """GPT-2's tokenizer files (vocab.json, merges.txt, tokenizer_config.json for GPT2Tokenizer) from the local
    tiktoken ranks; a note saying why instead when there are none, or the vocabulary is not GPT-2's."""
    if config.vocab_size < GPT2_VOCAB:
        return (f"no tokenizer written: the model's vocabulary of {config.vocab_size} tokens is not GPT-2's "
                f"{GPT2_VOCAB}")
    files = gpt2_bpe_files()
    if files is None:
        return ("no tokenizer written: the GPT-2 BPE ranks are not in the local cache; run `python -m data.tokenizer` "
                "and export again, or load the same tokenizer with GPT2TokenizerFast.from_pretrained('gpt2')")
    tokenizer = {"tokenizer_class": "GPT2Tokenizer", "bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT,
                 "unk_token": ENDOFTEXT, "add_prefix_space": False, "add_bos_token": False,
                 "clean_up_tokenization_spaces": False, "model_max_length": config.block_size}
    for name, text in (("vocab.json", files[0]), ("merges.txt", files[1]),
                       ("tokenizer_config.json", json.dumps(tokenizer, indent=2) + "\n")):
        atomic_write(out_dir / name, text.encode())
    return None


def export_model(model: train_gpt.GPT, out_dir: str | os.PathLike) -> list[str]:
    """Write `model` to `out_dir` (see the module docstring): model.safetensors, config.json,
    generation_config.json, the tokenizer and, for PReLU, modeling_symgpt.py. The directory appears whole or not
    at all, readable as the umask allows (like a directory made by mkdir). Returns notes for the user."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {out_dir} is a file; to-hf writes a directory: choose a new directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ExportError(f"--out {out_dir} exists and is not empty; choose a new directory")
    if model.config.attention != "standard":
        raise ExportError(f"--attention {model.config.attention}: relational attention (a score MLP over the Gram "
                          "matrix, no query/key/value projections) has no GPT-2 layout to export to; sample and "
                          "evaluate the checkpoint itself (python -m sample, python -m eval.*)")
    if model.config.objective != "clm":
        raise ExportError(f"--objective {model.config.objective}: a masked LM attends in both directions and does not "
                          "predict the next token, so GPT-2's causal classes and text-generation tools would run it "
                          "wrongly; evaluate the checkpoint itself (python -m eval.*)")
    config = exported_model_config(model.config)
    with doing("create a staging directory for", out_dir):
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=make_directory(out_dir.parent)))
    try:
        with doing("write", out_dir / WEIGHTS_FILE):
            save_safetensors(hf_state_dict(model), staging / WEIGHTS_FILE)
        atomic_write(staging / CONFIG_FILE, (json.dumps(hf_config(config), indent=2) + "\n").encode())
        atomic_write(staging / GENERATION_FILE, (json.dumps(generation_config(config), indent=2) + "\n").encode())
        if config.activation == "prelu":
            shutil.copyfile(MODELING_FILE, staging / MODELING_FILE.name)
        note = write_tokenizer(staging, config)
        mask = os.umask(0o022)  # os.umask reads the umask only by setting it
        os.umask(mask)
        with doing("write", out_dir):
            for path in staging.iterdir():
                path.chmod(0o666 & ~mask)
            staging.chmod(0o777 & ~mask)  # mkdtemp made it 0700
            if out_dir.exists():
                out_dir.rmdir()
            staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [note] if note else []


def save_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, whose error for the file it writes (a full disk, ...) is an OSError here: it reports
    the system's error as text ("... (os error 28)")."""
    try:
        save_file(state, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None


HF_SIZES = {"vocab_size": GPT2_VOCAB, "n_positions": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}  # defaults


def config_from_exported(meta: dict, source: Path) -> train_gpt.GPTConfig:
    """Our GPTConfig for a directory's config.json: a GPT2Config or our SymGPTConfig (PReLU)."""
    if meta.get("model_type") not in ("gpt2", MODEL_TYPE):
        raise ExportError(f"{source / CONFIG_FILE}: neither a GPT-2 config (model_type 'gpt2') nor one of ours "
                          f"(model_type '{MODEL_TYPE}'); its model_type is {meta.get('model_type')!r}: export the "
                          "checkpoint it came from again with `python -m export to-hf`")
    sizes = {key: meta.get(key, default) for key, default in HF_SIZES.items()}
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ExportError(f"{source / CONFIG_FILE}: {key} = {value!r}; a GPT-2 needs a positive integer")
    n_embd = sizes["n_embd"]
    if n_embd % sizes["n_head"]:
        raise ExportError(f"{source / CONFIG_FILE}: n_embd = {n_embd} does not split into n_head = {sizes['n_head']} "
                          "heads")
    unsupported = {
        "n_inner": (meta.get("n_inner") or 4 * n_embd, 4 * n_embd),
        "layer_norm_epsilon": (meta.get("layer_norm_epsilon", LAYER_NORM_EPS), LAYER_NORM_EPS),
        "scale_attn_weights": (meta.get("scale_attn_weights", True), True),
        "scale_attn_by_inverse_layer_idx": (meta.get("scale_attn_by_inverse_layer_idx", False), False),
        "tie_word_embeddings": (meta.get("tie_word_embeddings", True), True),
    }
    for key, (value, ours) in unsupported.items():
        if value != ours:
            raise ExportError(f"{source / CONFIG_FILE}: {key} = {value!r}; our GPT supports only {ours!r}")
    activation = meta.get("activation_function", HF_DEFAULT_ACTIVATION)
    supported = ("prelu",) if meta["model_type"] == MODEL_TYPE else ("gelu", "gelu_new", "gelu_pytorch_tanh")
    if activation not in supported:
        raise ExportError(f"{source / CONFIG_FILE}: activation_function {activation!r}; model_type "
                          f"{meta['model_type']!r} supports {', '.join(supported)} here")
    return train_gpt.GPTConfig(vocab_size=sizes["vocab_size"], block_size=sizes["n_positions"],
                               n_layer=sizes["n_layer"], n_head=sizes["n_head"], n_embd=n_embd,
                               activation="prelu" if activation == "prelu" else "gelu", bias_mode="none")


def model_from_hf_state_dict(state: dict[str, torch.Tensor], config: train_gpt.GPTConfig) -> train_gpt.GPT:
    """Our GPT from GPT-2-named tensors (with or without the `transformer.` prefix); the inverse of hf_state_dict."""
    model = train_gpt.GPT(config)
    ours = {}
    for name, tensor in state.items():
        key = name.removeprefix("transformer.")
        if key == "lm_head.weight" or key.endswith(IGNORED_HF_BUFFERS):
            continue
        ours["transformer." + key] = tensor.t() if key.endswith(CONV1D_WEIGHTS) else tensor
    ours["lm_head.weight"] = ours["transformer.wte.weight"]
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(ours)), sorted(set(ours) - set(expected))
    if missing or unexpected:
        raise ExportError(f"the weights do not fit a GPT-2 of this config: missing {missing[:4]}, unexpected "
                          f"{unexpected[:4]}")
    for name, tensor in ours.items():
        if tensor.shape != expected[name].shape:
            raise ExportError(f"{name}: shape {tuple(tensor.shape)}, the config needs {tuple(expected[name].shape)}")
    model.load_state_dict(ours)
    return model.eval()


def resolve_source(source: str) -> Path:
    """A local directory, or a Hugging Face hub id (e.g. "gpt2") downloaded into the hub's cache."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists() or source.startswith((".", "/")) or source.count("/") > 1:
        raise ExportError(f"--source {source}: not a directory holding {CONFIG_FILE} and {WEIGHTS_FILE}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE]))
    except Exception as exc:  # the hub reports offline use, unknown repos and network errors by several types
        raise ExportError(f"--source {source}: no such directory, and the Hugging Face hub gave no model "
                          f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); "
                          "give a local directory with config.json and model.safetensors") from exc


def load_exported(source: str | os.PathLike) -> train_gpt.GPT:
    """Our GPT (eval mode, CPU) from a directory written by export_model or a GPT-2 directory with safetensors."""
    path = resolve_source(str(source))
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise ExportError(f"{path}: no {name}; give a directory written by `python -m export to-hf` or a "
                              "Hugging Face GPT-2 directory with safetensors weights")
    try:
        meta = json.loads((path / CONFIG_FILE).read_text())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ExportError(f"{path / CONFIG_FILE}: not a JSON config ({exc}); the file is damaged: export or "
                          "download the directory again") from None
    if not isinstance(meta, dict):
        raise ExportError(f"{path / CONFIG_FILE}: holds a JSON {type(meta).__name__}, not a config object")
    config = config_from_exported(meta, path)
    activation = meta.get("activation_function", HF_DEFAULT_ACTIVATION)
    if activation in ("gelu_new", "gelu_pytorch_tanh"):
        print(f"note: {path} uses activation_function {activation!r} (the tanh approximation of GELU); our GPT "
              "uses exact GELU, so logits differ slightly from the original", file=sys.stderr)
    try:
        state = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:
        raise ExportError(f"{path / WEIGHTS_FILE}: not a readable safetensors file ({exc}); it is truncated or "
                          "damaged: export or download the directory again") from None
    return model_from_hf_state_dict(state, config)


def model_file(source: str | os.PathLike) -> Path:
    """The file behind a --checkpoint value: a run directory's checkpoints/latest.pt, a checkpoint file, or the
    model.safetensors of a directory written by `python -m export to-hf` (or any GPT-2 directory)."""
    path = Path(source)
    if path.is_dir() and (path / WEIGHTS_FILE).is_file():
        return path / WEIGHTS_FILE
    try:
        return resolve_checkpoint_path(path, flag="--checkpoint")
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}. --checkpoint takes a run directory, a checkpoint file, or a directory written "
                              "by `python -m export to-hf` (model.safetensors + config.json)") from None


def is_exported(file: Path) -> bool:
    """Whether a file from model_file is an exported directory's weights (else one of our checkpoints)."""
    return file.suffix == ".safetensors"


def load_model(source: str | os.PathLike) -> train_gpt.GPT:
    """The model a --checkpoint value names (see model_file), in eval mode on the CPU."""
    file = model_file(source)
    if is_exported(file):
        return load_exported(file.parent)
    return train_gpt.model_from_checkpoint(load_as_checkpoint(file))


def load_as_checkpoint(file: Path) -> dict:
    """A model_file as our checkpoint dict: the checkpoint itself (mapped, its checksum verified and its model
    configuration checked: a damaged or altered file is a CheckpointError, not a wrong number), or an exported model
    at step 0."""
    return checkpoint_of(load_exported(file.parent), str(file.parent)) if is_exported(file) else (
        read_checkpoint(file, train_gpt.GPTConfig, train_gpt.TrainConfig, mmap=True, verify=True))


def checkpoint_of(model: train_gpt.GPT, source: str) -> dict:
    """A checkpoint of kind weights holding the model (step 0, the default training config, no recorded data or
    attention path: readers take the default), for --init-from, sample and eval."""
    optimizer = train_gpt.TrainConfig.optimizer
    saved = {"model": dataclasses.asdict(model.config), "train": dataclasses.asdict(train_gpt.TrainConfig()),
             "research": dataclasses.asdict(ResearchConfig()),
             "optim": dataclasses.asdict(OPTIMIZERS[optimizer].config()), "data": None, "preset": None,
             "attention": None}
    return weights_checkpoint(model, saved, {"step": 0, "tokens": 0, "train_time_s": 0.0}, imported_from=source)


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(module="export", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    commands = parser.add_subparsers(dest="command", required=True)
    to_hf = commands.add_parser("to-hf", help="checkpoint -> a Hugging Face directory (GPT-2 layout, safetensors)")
    add_model_flag(to_hf)
    to_hf.add_argument("--out", required=True, type=Path, help="new output directory")
    from_hf = commands.add_parser("from-hf", help="GPT-2 directory or hub id -> our checkpoint (for sample/eval)")
    from_hf.add_argument("--source", required=True,
                         help="directory with config.json + model.safetensors, or a hub id such as gpt2")
    from_hf.add_argument("--out", required=True, type=Path, help="checkpoint file to write (.pt)")
    args = parser.parse_args(argv)
    try:
        if args.command == "to-hf":
            model = load_model(args.checkpoint)
            if problem := non_finite_weights(model.state_dict()):
                raise ExportError(f"{args.checkpoint}: {problem}: the run had diverged; export a checkpoint of an "
                                  "earlier step")
            notes = export_model(model, args.out)
            how = (f'GPT2LMHeadModel.from_pretrained("{args.out}")' if model.config.activation == "gelu" else
                   f'AutoModelForCausalLM.from_pretrained("{args.out}", trust_remote_code=True) (GPT-2 with a '
                   f'per-feature PReLU; the model class is {MODELING_FILE.name}, beside the weights)')
            print(f"wrote {args.out}: mean biases folded into c_attn.bias; load it with {how}")
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
        else:
            if args.out.exists():
                raise ExportError(f"--out {args.out} exists; choose a new file")
            model = load_exported(args.source)
            if problem := non_finite_weights(model.state_dict()):
                raise ExportError(f"{args.source}: {problem}; import a model whose weights are finite")
            save_checkpoint(args.out, checkpoint_of(model, args.source))
            print(f"wrote {args.out}: {model.get_num_params():,} parameters from {args.source}")
    except (ExportError, CheckpointError) as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
