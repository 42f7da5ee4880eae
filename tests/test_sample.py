"""sample.generate and `python -m sample`: greedy and top-k decoding, seeded sampling, the padded vocabulary, context
cropping, checkpoints given as files, run directories or exported directories, and the errors for bad flags."""
from __future__ import annotations

import pytest
import torch

import export
import kv_cache
import sample
import train_gpt
from eval import val_loss
from data.shards import GPT2_VOCAB
from run.checkpoint import save_checkpoint
from tests.helpers import tiny_gpt


def tiny_model(**overrides) -> train_gpt.GPT:
    """The shared tiny GPT with GPT-2's vocabulary (the tokenizer's prompts), GELU and generic weights."""
    return tiny_gpt(noise=0.1, **{"vocab_size": 50304, "activation": "gelu", "bias_mode": "bqbv", **overrides}).eval()


@pytest.fixture(scope="module")
def model() -> train_gpt.GPT:
    return tiny_model()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model) -> str:
    run = tmp_path_factory.mktemp("run")
    (run / "checkpoints").mkdir()
    save_checkpoint(run / "checkpoints" / "latest.pt", export.checkpoint_of(model, "test"))
    return str(run)


def greedy_by_hand(model: train_gpt.GPT, idx: torch.Tensor, steps: int, vocab: int) -> torch.Tensor:
    for _ in range(steps):
        logits = model(idx[:, -model.config.block_size:], biases=model.mean_biases)[0][:, -1, :vocab]
        idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
    return idx


def test_greedy_generation_follows_the_mean_bias_logits(model):
    idx = torch.randint(0, GPT2_VOCAB, (2, 5))
    out = sample.generate(model, idx, 6, temperature=0, vocab_limit=GPT2_VOCAB)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], idx)
    assert torch.equal(out, greedy_by_hand(model, idx, 6, GPT2_VOCAB))
    assert torch.equal(sample.generate(model, idx, 6, temperature=1.0, top_k=1, vocab_limit=GPT2_VOCAB), out)


def test_context_is_cropped_to_block_size(model):
    idx = torch.randint(0, GPT2_VOCAB, (1, 40))  # longer than block_size 32
    out = sample.generate(model, idx, 3, temperature=0)
    assert out.shape == (1, 43)
    assert torch.equal(out, greedy_by_hand(model, idx, 3, model.config.vocab_size))


def test_sampling_is_seeded_and_respects_top_k_and_vocab_limit(model):
    idx = torch.zeros((64, 1), dtype=torch.long)
    draw = lambda seed, **kw: sample.generate(model, idx, 1, generator=torch.Generator().manual_seed(seed), **kw)[:, 1]
    assert torch.equal(draw(3, temperature=2.0), draw(3, temperature=2.0))
    assert not torch.equal(draw(3, temperature=2.0), draw(4, temperature=2.0))
    logits = model(idx[:1])[0][0, -1]
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert set(draw(5, temperature=5.0, top_k=3).tolist()) <= top3
    model_small_vocab = sample.generate(model, idx, 1, temperature=50.0, vocab_limit=10,
                                       generator=torch.Generator().manual_seed(0))[:, 1]
    assert model_small_vocab.max() < 10


@pytest.mark.parametrize("overrides", [dict(), dict(bias_per_head=True, key_bias=True), dict(bias_mode="learned"),
                                       dict(activation="prelu", bias_mode="bv"), dict(bias_mode="none")])
def test_the_kv_cache_gives_the_tokens_of_rerunning_the_window(overrides):
    """Greedy and seeded sampling draw the same tokens with the cache as without, before and after the context
    outgrows block_size (16: a 5-token prompt and 14 new tokens cross it)."""
    model = tiny_model(block_size=16, **overrides)
    idx = torch.randint(0, GPT2_VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    greedy = sample.generate(model, idx, 14, temperature=0, vocab_limit=GPT2_VOCAB)
    assert greedy.shape == (3, 19) and torch.equal(greedy, greedy_by_hand(model, idx, 14, GPT2_VOCAB))
    for kwargs in (dict(temperature=1.0, top_k=50), dict(temperature=2.0)):
        cached, rerun = (sample.generate(model, idx, 14, vocab_limit=GPT2_VOCAB,
                                         generator=torch.Generator().manual_seed(5),
                                         use_cache=use_cache, **kwargs) for use_cache in (True, False))
        assert torch.equal(cached, rerun), kwargs


def test_the_kv_cache_reads_each_token_once_while_the_context_fits(model, monkeypatch):
    """Forward passes see the prompt, then one token per step; past block_size, the whole window each step."""
    seen = []
    forward = train_gpt.GPT.forward
    monkeypatch.setattr(train_gpt.GPT, "forward", lambda self, idx, *a, **kw: seen.append(idx.size(1))
                        or forward(self, idx, *a, **kw))
    sample.generate(model, torch.zeros((1, 30), dtype=torch.long), 5, temperature=0)
    assert seen == [30, 1, 1, 32, 32]
    seen.clear()
    sample.generate(model, torch.zeros((1, 30), dtype=torch.long), 3, temperature=0, use_cache=False)
    assert seen == [30, 31, 32]


def test_cached_logits_equal_the_full_forward(model):
    idx = torch.randint(0, GPT2_VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    full = model(idx, all_logits=True)[0]
    cache = kv_cache.for_model(model.config)
    stepwise = torch.cat([model(idx[:, :4], cache=cache, all_logits=True)[0]]
                         + [model(idx[:, t:t + 1], cache=cache)[0] for t in range(4, 12)], dim=1)
    torch.testing.assert_close(stepwise, full, rtol=1e-5, atol=1e-5)
    assert cache.length == 12
    with pytest.raises(ValueError, match="exceeds block_size 32"):
        model(torch.zeros((2, 21), dtype=torch.long), cache=cache)


def test_relational_attention_generates_without_a_cache():
    model = tiny_model(attention="relational", bias_mode="none")
    assert kv_cache.for_model(model.config) is None
    idx = torch.randint(0, GPT2_VOCAB, (1, 4), generator=torch.Generator().manual_seed(4))
    assert torch.equal(sample.generate(model, idx, 3, temperature=0),
                       greedy_by_hand(model, idx, 3, model.config.vocab_size))


def test_cli_samples_from_a_run_directory_reproducibly(run_dir, capsys):
    args = ["--checkpoint", run_dir, "--prompt", "Hello world", "--max-new-tokens", "5", "--num-samples", "2",
            "--seed", "7", "--device", "cpu"]
    first = sample.main(args)
    assert len(first) == 2 and all(isinstance(t, str) and t for t in first)
    assert sample.main(args) == first
    assert capsys.readouterr().out.count("Hello world") == 4


def test_cli_greedy_matches_generate_on_a_checkpoint_file(run_dir, model):
    from data.tokenizer import gpt2_tokenizer

    enc = gpt2_tokenizer()
    texts = sample.main(["--checkpoint", f"{run_dir}/checkpoints/latest.pt", "--prompt", "The cat",
                         "--max-new-tokens", "4", "--temperature", "0"])
    prompt = torch.tensor([enc.encode("The cat")])
    expected = greedy_by_hand(model, prompt, 4, GPT2_VOCAB)[0, prompt.size(1):].tolist()
    assert texts == [enc.decode(expected)]


def test_cli_samples_from_an_exported_directory(tmp_path, model):
    export.export_model(model, tmp_path / "hf")
    args = ["--prompt", "The cat", "--max-new-tokens", "4", "--temperature", "0"]
    exported = sample.main(["--checkpoint", str(tmp_path / "hf"), *args])
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    save_checkpoint(run / "latest.pt", export.checkpoint_of(model, "test"))
    assert exported == sample.main(["--checkpoint", str(tmp_path / "run"), *args])


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0: greedy), got nan"),
    (["--seed", "99999999999999999999999"], "--seed must be in [0, 4294967295], got 99999999999999999999999"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--top-k", "-2"], "--top-k must be >= 0"),
    (["--num-samples", "0"], "--num-samples must be >= 1"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file /nonexistent/prompt.txt: no such file"),
])
def test_bad_flags_are_named(run_dir, flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sample.main(["--checkpoint", run_dir, *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_prompt_file_that_is_not_utf8_is_named(run_dir, tmp_path, capsys):
    prompt = tmp_path / "latin1.txt"
    prompt.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(SystemExit) as exc:
        sample.main(["--checkpoint", run_dir, "--prompt-file", str(prompt)])
    assert exc.value.code == 2
    assert f"--prompt-file {prompt}: not UTF-8 text (invalid continuation byte at byte 3); save it as UTF-8" in (
        capsys.readouterr().err)


def test_run_is_another_spelling_of_checkpoint(run_dir, capsys):
    args = ["--prompt", "Hi", "--max-new-tokens", "3", "--temperature", "0"]
    assert sample.main(["--run", run_dir, *args]) == sample.main(["--checkpoint", run_dir, *args])
    with pytest.raises(SystemExit):
        sample.main(["--run", run_dir, "--checkpoint", run_dir, *args])
    assert "--checkpoint / --run given twice; name one model" in capsys.readouterr().err


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(SystemExit, match="--checkpoint: no checkpoint at"):
        sample.main(["--checkpoint", str(tmp_path / "nothing")])


@pytest.mark.cuda
def test_greedy_generation_on_cuda_matches_the_cpu(model):
    idx = torch.randint(0, GPT2_VOCAB, (2, 5))
    on_gpu = sample.generate(model.to("cuda"), idx.cuda(), 4, temperature=0, vocab_limit=GPT2_VOCAB).cpu()
    model.to("cpu")
    assert torch.equal(on_gpu[:, :5], idx)
    for t in range(5, 9):  # every token the GPU chose is the CPU's argmax, up to float ties
        logits = model(on_gpu[:, :t])[0][:, -1, :GPT2_VOCAB]
        chosen = logits.gather(1, on_gpu[:, t:t + 1]).squeeze(1)
        assert (logits.max(dim=-1).values - chosen).max() < 1e-4


@pytest.mark.cuda
def test_kv_cache_on_cuda_in_bf16_matches_the_full_forward():
    """The first step runs the Triton kernel (d = 64, as many keys as queries), later ones SDPA against the cache."""
    model = tiny_model(n_embd=128, n_head=2).to("cuda")
    idx = torch.randint(0, GPT2_VOCAB, (2, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    cache = kv_cache.for_model(model.config)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        full = model(idx, all_logits=True)[0].float()
        stepwise = torch.cat([model(idx[:, :4], cache=cache, all_logits=True)[0]]
                             + [model(idx[:, t:t + 1], cache=cache)[0] for t in range(4, 12)], dim=1).float()
    torch.testing.assert_close(stepwise, full, rtol=5e-2, atol=5e-2)


@pytest.mark.cuda
def test_cli_samples_on_cuda_in_bf16(run_dir):
    texts = sample.main(["--checkpoint", run_dir, "--device", "cuda", "--dtype", "bf16", "--max-new-tokens", "5",
                         "--num-samples", "2"])
    assert len(texts) == 2


def test_a_masked_lm_model_refuses_to_generate():
    with pytest.raises(ValueError, match="--objective mlm"):
        sample.generate(tiny_model(objective="mlm"), torch.zeros(1, 4, dtype=torch.long), 2)


@pytest.mark.parametrize("main", [sample.main, val_loss.main], ids=["sample", "eval.val_loss"])
def test_device_cuda_without_cuda_is_a_one_line_error(run_dir, monkeypatch, main):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda: no CUDA device is available"):
        main(["--checkpoint", run_dir, "--device", "cuda"])
