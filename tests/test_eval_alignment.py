"""eval.alignment (docs/evaluation.md): category rules, the null threshold, and a planted alignment recovered with
enrichment."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data.tokenizer import gpt2_tokenizer
from eval.alignment import (
    analyze,
    enrichment,
    evaluate_alignment,
    expected_null_max,
    null_threshold,
    token_category,
    vocabulary,
)
from tests.helpers import tiny_gpt


@pytest.mark.parametrize("text, category", [
    (" the", "function_words"), (" of", "function_words"), (".", "punctuation"), (").", "punctuation"),
    (" —", "punctuation"), ("?", "punctuation"), (" What", "interrogatives"), (" how", "interrogatives"),
    (" However", "sentence_starters"), (" Interestingly", "sentence_starters"), (" The", "sentence_starters"),
    ("\ufffd", "unicode_noise"), ("\\\\", "unicode_noise"), (" {", "unicode_noise"), (" apple", None),
    (" 42", None), (" Paris", None), ("\n\n", None),
])
def test_category_rules_on_known_tokens(text, category):
    ids = gpt2_tokenizer().encode(text)
    assert len(ids) == 1, f"{text!r} should be one GPT-2 token"
    assert token_category(gpt2_tokenizer().decode_single_token_bytes(ids[0])) == category


def test_broken_utf8_and_cjk_are_noise():
    assert token_category(b"\xe2\x80") == "unicode_noise"  # first two bytes of a 3-byte character
    assert token_category(" 東京".encode()) == "unicode_noise"
    assert token_category(" café".encode()) is None  # Latin-1 letters are ordinary text


def test_null_threshold_matches_the_paper_and_simulation():
    assert abs(null_threshold(64, 50257) - 0.58) < 0.02
    rng = np.random.default_rng(0)
    d, vocab, trials = 16, 2000, 400
    maxima = []
    for _ in range(trials):
        x = rng.standard_normal((vocab, d))
        maxima.append((x[:, 0] / np.linalg.norm(x, axis=1)).max())
    assert abs(np.mean(maxima) - expected_null_max(d, vocab)) < 0.01
    assert abs(np.quantile(maxima, 0.9) - null_threshold(d, vocab, quantile=0.9)) < 0.02
    assert expected_null_max(64, 50257) < null_threshold(64, 50257)


def test_enrichment_is_log2_ratio_with_pseudo_counts():
    top = ["punctuation"] * 7 + [None] * 8
    bottom = ["unicode_noise"] * 3 + ["punctuation"] + [None] * 11
    e = enrichment(top, bottom)
    assert e["punctuation"] == pytest.approx(np.log2(7.5 / 1.5))
    assert e["unicode_noise"] == pytest.approx(np.log2(0.5 / 3.5))
    assert e["interrogatives"] == 0.0


@pytest.mark.parametrize("n_head", [1, 2])
def test_planted_alignment_is_recovered_with_punctuation_enriched(n_head):
    model = tiny_gpt(0, vocab_size=50304, n_head=n_head, n_embd=64, bias_mode="bq")
    _, categories = vocabulary()
    punct = [i for i, c in enumerate(categories) if c == "punctuation"][:20]
    noise = [i for i, c in enumerate(categories) if c == "unicode_noise"][:20]
    with torch.no_grad():
        wte = model.transformer.wte.weight
        for block in model.transformer.h[:1]:  # plant in layer 0's keys (raw mode: k = W_K wte[x])
            w_k = block.attn.c_attn.weight[64:128]
            target = torch.ones(64)  # E[b_Q] direction in every head
            for sign, ids in ((1.0, punct), (-1.0, noise)):
                keys = sign * target + 0.1 * torch.randn(len(ids), 64)
                wte[ids] = torch.linalg.solve(w_k, keys.T).T
    result = evaluate_alignment(model, "raw", torch.device("cpu"))
    layer0 = [h for h in result["heads"] if h["layer"] == 0]
    for head in layer0:
        assert {t["id"] for t in head["top"]} <= set(punct)
        assert {t["id"] for t in head["bottom"]} <= set(noise)
        assert head["top_alignment"] > 0.9 > result["null_threshold"]
    per_layer = result["enrichment"]["per_layer"]
    assert per_layer[0]["punctuation"] > 3 and per_layer[0]["unicode_noise"] < -3
    assert per_layer[0]["punctuation"] == max(per_layer[0].values())
    assert abs(per_layer[1]["punctuation"]) < 3  # layer 1 untouched: no planted structure
    assert result["enrichment"]["pooled"]["punctuation"] > 1
    assert result["frac_above_null"] >= 0.5  # layer 0's heads are; the random layer 1's mostly are not


def test_analyze_statistics_on_random_scores():
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(2, 3, 500, generator=g) * 2 - 1
    ids = torch.arange(500) * 7
    strings, categories = vocabulary()
    out = analyze(scores, ids, strings, categories, head_dim=8)
    top = scores.max(dim=-1).values
    assert out["mean_top"] == pytest.approx(top.mean().item())
    assert out["max_top"] == pytest.approx(top.max().item())
    assert out["frac_above_null"] == pytest.approx((top > out["null_threshold"]).float().mean().item())
    head = out["heads"][4]  # layer 1, head 1
    assert [t["id"] for t in head["top"]] == (ids[scores[1, 1].argsort(descending=True)[:15]]).tolist()
    assert [t["id"] for t in head["bottom"]] == (ids[scores[1, 1].argsort()[:15]]).tolist()
