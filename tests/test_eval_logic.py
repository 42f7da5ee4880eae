"""eval.logic_puzzles (docs/evaluation.md, arXiv 2601.22257 App. E.1): suites, generators, scoring and intervals."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from data.shards import EOT_TOKEN, GPT2_VOCAB
from data.tokenizer import gpt2_tokenizer
from eval.common import error_bars, wilson_interval
from eval.logic_puzzles import (
    CATEGORIES,
    FIXED_SUITE,
    encode_items,
    generate_suite,
    load_suite,
    score_items,
    summarize,
)
from train_gpt import GPT, GPTConfig


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


def test_bad_suites_are_rejected_with_the_file_named(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"items": [{"prompt": "1, 2,", "expected": " 3"}]}))
    with pytest.raises(ValueError, match="bad.json.*category"):
        load_suite(path)
    items = [{"id": "x", "category": "copy", "prompt": "a b", "expected": " photosynthesis"}]
    with pytest.raises(ValueError, match="photosynthesis"):
        encode_items(items, gpt2_tokenizer(), "mine")


def test_scores_match_one_prompt_at_a_time_forward():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50304, block_size=64, n_layer=1, n_head=2, n_embd=32, bias_mode="bqbv")).eval()
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
