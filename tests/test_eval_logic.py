"""eval.logic_puzzles (docs/evaluation.md, arXiv 2601.22257 App. E.1): suites (ours, generated, the paper's),
generators, the two scoring protocols and intervals."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from data.shards import EOT_TOKEN, GPT2_VOCAB
from export import checkpoint_of
from data.tokenizer import gpt2_tokenizer
from eval.figures import error_bars
from eval.samples import wilson_interval
from eval import logic_puzzles
from eval.logic_puzzles import (
    CATEGORIES,
    FIXED_SUITE,
    PAPER_SUITE,
    encode_items,
    generate_suite,
    load_suite,
    score_items,
    summarize,
)
from run.checkpoint import save_checkpoint
from tests.helpers import tiny_gpt
from train_gpt import GPT


def test_generated_suite_is_deterministic_large_and_single_token():
    a, b = generate_suite(seed=3, per_category=200), generate_suite(seed=3, per_category=200)
    assert a == b
    assert generate_suite(seed=4, per_category=200)["items"] != a["items"]
    enc = gpt2_tokenizer()
    for category in CATEGORIES:
        items = [i for i in a["items"] if i["category"] == category]
        assert len(items) == 200 and len({i["prompt"] for i in items}) == 200
        assert all(len(enc.encode(i["expected"])) == 1 for i in items)
    assert len(encode_items(a["items"], enc)) == 1200


def test_fixed_suite_covers_every_category_with_single_token_answers():
    suite = load_suite(FIXED_SUITE)
    for category in CATEGORIES:
        assert sum(i["category"] == category for i in suite["items"]) >= 4
    encoded = encode_items(suite["items"], gpt2_tokenizer())
    assert all(tokens[0] == EOT_TOKEN for tokens, _ in encoded)


# The prompts arXiv 2601.22257 prints (App. E.1's example, Tables 17-20) and the first answer token it names.
PAPER_QUOTES = {
    "1, 2, 3, 4,": " 5",
    "If it rains, the ground gets wet. It is raining. The ground": " gets",
    "Alice likes apples. Bob likes bananas. Carol likes cherries. Dave likes dates. Alice likes": " apples",
    "The color is blue. The shape is round. The color is": " blue",
    "X, Y, Z, A,": " B",
}


def test_paper_suite_holds_the_papers_fourteen_items_scored_by_the_first_answer_token():
    suite = load_suite(PAPER_SUITE)
    enc = gpt2_tokenizer()
    assert suite["protocol"] == "paper" and len(suite["items"]) == 14
    counts = {c: sum(i["category"] == c for i in suite["items"]) for c in CATEGORIES}
    assert counts == {"pattern_numeric": 4, "pattern_alpha": 2, "retrieval_near": 2, "retrieval_far": 2,
                      "simple_inference": 2, "copy": 2}  # Table 15: numeric in quarters, the others in halves
    encoded = encode_items(suite["items"], enc, "paper", protocol="paper")
    first_token = {item["prompt"]: enc.decode([target]) for item, (_, target) in zip(suite["items"], encoded)}
    assert {prompt: first_token.get(prompt) for prompt in PAPER_QUOTES} == PAPER_QUOTES
    assert all(tokens == enc.encode(item["prompt"]) for item, (tokens, _) in zip(suite["items"], encoded))
    with pytest.raises(ValueError, match="gets wet.*--protocol paper"):  # ours wants one-token answers
        encode_items(suite["items"], enc, "paper", protocol="ours")


def planted_padding_model() -> GPT:
    """Final features fixed to e_0 (ln_f weight 0, bias e_0), so the logits are the LM head's column 0; padding id
    50300 gets logit 5, far above every real token's (N(0, 0.02))."""
    model = tiny_gpt(0, vocab_size=50304, block_size=64, n_layer=1, bias_mode="bqbv").eval()
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.lm_head.weight[50300, 0] = 5.0
    return model


@pytest.mark.parametrize("protocol", ["ours", "paper"])
def test_each_protocol_ranks_and_normalises_over_its_own_vocabulary(protocol):
    model = planted_padding_model()
    items = load_suite(PAPER_SUITE)["items"]
    if protocol == "ours":
        items = [i for i in items if len(gpt2_tokenizer().encode(i["expected"])) == 1]
    result = logic_puzzles.evaluate_suite(model, {"name": "paper", "items": items}, torch.device("cpu"),
                                          batch_size=4, protocol=protocol)
    column = model.lm_head.weight[:, 0].detach()  # the logits exactly: the final features are e_0
    logp = F.log_softmax(column if protocol == "paper" else column[:GPT2_VOCAB], dim=-1)
    enc = gpt2_tokenizer()
    for item, scored in zip(items, result["items"]):
        target = enc.encode(item["expected"])[0]
        assert scored["logprob"] == pytest.approx(logp[target].item(), abs=1e-5)
        assert scored["rank"] == int((logp > logp[target]).sum()) + 1
        assert (scored["top5"][0] == "<padding 50300>") == (protocol == "paper")
    assert result["protocol"] == protocol


def test_scores_match_one_prompt_at_a_time_forward_under_the_paper_protocol():
    model = tiny_gpt(0, vocab_size=50304, block_size=64, n_layer=1, bias_mode="bqbv").eval()
    encoded = encode_items(load_suite(PAPER_SUITE)["items"], gpt2_tokenizer(), protocol="paper")
    scores = score_items(model, encoded, torch.device("cpu"), batch_size=5, protocol="paper")
    for (tokens, target), s in zip(encoded, scores):
        assert tokens[0] != EOT_TOKEN
        with torch.no_grad():
            logp = F.log_softmax(model(torch.tensor([tokens]))[0][0, -1, :], dim=-1)  # all 50304 logits
        assert s["logprob"] == pytest.approx(logp[target].item(), abs=1e-4)
        assert s["rank"] == int((logp > logp[target]).sum()) + 1


def test_cli_scores_each_suite_with_its_protocol(tmp_path):
    model = tiny_gpt(0, vocab_size=50304, block_size=64, n_layer=1, n_embd=16, bias_mode="bqbv")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    save_checkpoint(run / "checkpoints" / "latest.pt", checkpoint_of(model, "a test"))
    paper = logic_puzzles.main(["--run", str(run), "--protocol", "paper", "--no-generated", "--out",
                                str(tmp_path / "a")])
    assert [(s["name"], s["protocol"], s["overall"]["n"]) for s in paper["suites"]] == [("paper", "paper", 14)]
    mixed = logic_puzzles.main(["--run", str(run), "--suite", "paper", "--suite", "fixed", "--no-generated",
                                "--out", str(tmp_path / "b")])
    assert [(s["name"], s["protocol"]) for s in mixed["suites"]] == [("paper", "paper"), ("fixed", "ours")]
    assert mixed["suites"][0]["overall"] == paper["suites"][0]["overall"]
    assert "protocol `paper`" in (tmp_path / "b" / "logic_puzzles.md").read_text()
    with pytest.raises(ValueError, match="--protocol paper"):
        logic_puzzles.main(["--run", str(run), "--suite", "paper", "--protocol", "ours", "--no-generated", "--out",
                            str(tmp_path / "c")])


def test_bad_suites_are_rejected_with_the_file_named(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"items": [{"prompt": "1, 2,", "expected": " 3"}]}))
    with pytest.raises(ValueError, match="bad.json.*category"):
        load_suite(path)
    items = [{"id": "x", "category": "copy", "prompt": "a b", "expected": " photosynthesis"}]
    with pytest.raises(ValueError, match="photosynthesis"):
        encode_items(items, gpt2_tokenizer(), "mine")


def test_scores_match_one_prompt_at_a_time_forward():
    model = tiny_gpt(0, vocab_size=50304, block_size=64, n_layer=1, bias_mode="bqbv").eval()
    suite = generate_suite(seed=1, per_category=2)
    encoded = encode_items(suite["items"], gpt2_tokenizer())
    scores = score_items(model, encoded, torch.device("cpu"), batch_size=5)  # padded batches
    for (tokens, target), s in zip(encoded, scores):
        with torch.no_grad():
            logp = F.log_softmax(model(torch.tensor([tokens]))[0][0, -1, :GPT2_VOCAB], dim=-1)
        assert s["logprob"] == pytest.approx(logp[target].item(), abs=1e-4)
        assert s["rank"] == int((logp > logp[target]).sum()) + 1
        assert s["top5"] == logp.topk(5).indices.tolist()


def test_summary_accuracies_losses_and_intervals():
    items = [{"category": "copy"}] * 4 + [{"category": "pattern_alpha"}] * 2
    ranks_logprobs = [(1, -0.5), (3, -2.0), (9, -4.0), (1, -0.1), (2, -1.0), (6, -3.0)]
    scores = [{"rank": r, "logprob": lp} for r, lp in ranks_logprobs]
    out = summarize(items, scores)
    assert out["categories"]["copy"]["top1"] == 0.5 and out["categories"]["copy"]["top5"] == 0.75
    assert out["categories"]["pattern_alpha"]["top5"] == 0.5
    assert out["overall"]["top5"] == pytest.approx(4 / 6)
    assert out["overall"]["top5_category_mean"] == pytest.approx(0.625)
    assert out["overall"]["logic_loss"] == pytest.approx(10.6 / 6)
    lo, hi = out["overall"]["top5_ci"]
    assert lo < 4 / 6 < hi


def test_wilson_interval_textbook_values():
    # Newcombe (1998), Statistics in Medicine 17:857, Table II, method 3 (Wilson score, 95%)
    for k, n, lo, hi in ((81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611),
                         (1, 29, 0.0061, 0.1718), (29, 29, 0.8830, 1.0)):
        low, high = wilson_interval(k, n)
        assert low == pytest.approx(lo, abs=1e-4) and high == pytest.approx(hi, abs=1e-4)
    low, high = wilson_interval(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-4) and high == pytest.approx(0.5962, abs=1e-4)


def test_wilson_interval_edges_bracket_the_score():
    for n in range(1, 400):  # the textbook centre ± half form put the lower bound above 0 at 0/11, 0/22, ...
        assert wilson_interval(0, n)[0] == 0.0 and wilson_interval(n, n)[1] == 1.0
        for k in range(0, n + 1, max(1, n // 7)):
            low, high = wilson_interval(k, n)
            assert 0.0 <= low <= k / n <= high <= 1.0
    assert all(math.isnan(v) for v in wilson_interval(0, 0))
    with pytest.raises(ValueError, match="3 of 2"):
        wilson_interval(3, 2)


def test_error_bars_are_never_negative():
    values = [0.0, 1.0, 0.5, 0.2]
    intervals = [(1e-17, 0.3), (0.7, 1.0 - 1e-16), (0.4, 0.6), (float("nan"), float("nan"))]
    below, above = error_bars(values, intervals)
    assert min(below + above) >= 0.0
    assert below == [0.0, pytest.approx(0.3), pytest.approx(0.1), 0.0]
    assert above == [pytest.approx(0.3), 0.0, pytest.approx(0.1), 0.0]
