"""b_Q alignment and semantic enrichment (docs/evaluation.md; arXiv 2601.22257 §5.2, App. E, G).

    python -m eval.alignment --run runs/NAME [--modes raw ln residual] [--residual-tokens 262144]

alignment(x) = cos(k(x), E[b_Q]) for every real GPT-2 token x (ids 0..50256), per layer and head, with the key k(x):
  raw       wte[x] A_K — the raw token embedding through W_K, no LayerNorm, no bias (parity with the paper);
  ln        ln_1(wte[x]) A_K + c_K — the layer's own LayerNorm and key bias;
  residual  the keys of the actual residual stream on validation text, averaged per token id (tokens never seen
            are left out).
E[b_Q] is μ_Q·1 for sampled biases (also for models trained without b_Q: the paper's null comparison) and the
learned b_q in `learned` mode. Per head: the top-15 (attention-enhanced) and bottom-15 (suppressed) tokens; the
mean and max over heads of the top alignment; the fraction of heads above the null threshold (`null_threshold`).
Semantic categories follow `token_category`; enrichment = log2(f_top / f_bottom) with 0.5 pseudo-counts, per layer
and pooled over layers (token occurrences counted over heads, as in the paper).
Writes `alignment.json`, `alignment_<mode>.png` (layer × head heatmap and enrichment bars), `alignment.md`, recorded
with the checkpoint in `manifest.json` (docs/evaluation.md#b_q-alignment-and-enrichment).
"""
from __future__ import annotations

import functools
import math
import unicodedata

import numpy as np
import torch
import torch.nn.functional as F

from cli import ArgumentParser
import train_gpt
from data.loader import validation_batches, validation_capacity
from data.shards import GPT2_VOCAB
from data.tokenizer import gpt2_tokenizer
from eval.configuration import run_hyperparameters, validation_files
from eval.figures import pyplot, save_figure
from eval.outputs import markdown_table, record_outputs, write_json
from eval.target import add_target_args, open_target
from fileio import atomic_write, exits_on_filesystem_errors

MODES = ("raw", "ln", "residual")
CATEGORIES = ("sentence_starters", "interrogatives", "punctuation", "function_words", "unicode_noise")
TOP_K = 15
NULL_QUANTILE = 0.99  # a head above this quantile of the null maximum is aligned beyond chance
PSEUDO_COUNT = 0.5

INTERROGATIVES = frozenset("what who whom whose which when where why how whether".split())
FUNCTION_WORDS = frozenset("""
the a an of to in on at by for with from about into onto over under after before between through during without
within upon against among across behind beyond toward towards since until unto via per and or but nor so yet as if
than that this these those it its is are was were be been being am have has had do does did will would shall should
can could may might must not no he she they we you i me him her them us my your his their our mine yours hers ours
theirs there here then also just very too such each every all both either neither some any many much more most few
other another own same only even still again ever never""".split())
DISCOURSE_MARKERS = frozenset("""
however therefore thus moreover furthermore additionally although because while when after before during given
considering assuming currently nonetheless nevertheless meanwhile instead indeed similarly consequently hence today
overall finally first second third next lastly once unlike despite according following based besides otherwise
regardless perhaps yes""".split())
NOISE_CHARACTERS = frozenset("\\{}<>|_~^`")


def token_category(token: bytes) -> str | None:
    """The semantic category of one token's bytes, or None ("other"). Rules, first match wins:

    1. unicode_noise: not valid UTF-8 (a piece of a multi-byte character), or contains U+FFFD, a control/format/
       private-use character, a code/markup character (\\ { } < > | _ ~ ^ `), or a character beyond Latin Extended-B
       (U+024F) other than General Punctuation (U+2000–U+206F): partial multilingual sequences and fragments.
    2. punctuation: after stripping whitespace, non-empty and every character is Unicode punctuation (P*).
    3. interrogatives: an alphabetic word (any case) in {what who whom whose which when where why how whether}.
    4. sentence_starters: a capitalised alphabetic word ("However", "A") that is a function word, a discourse
       marker (`DISCOURSE_MARKERS`) or an adverb in -ly ("Interestingly").
    5. function_words: a lower-case alphabetic word in `FUNCTION_WORDS` (articles, prepositions, conjunctions,
       pronouns, auxiliaries, quantifiers).
    Whitespace-only tokens, numbers, symbols and content words are "other".
    """
    try:
        text = token.decode("utf-8")
    except UnicodeDecodeError:
        return "unicode_noise"
    for ch in text:
        if ch in "\n\t\r ":
            continue
        code = ord(ch)
        if (ch == "\ufffd" or unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cs", "Cn") or ch in NOISE_CHARACTERS
                or (code > 0x24F and not 0x2000 <= code <= 0x206F)):
            return "unicode_noise"
    word = text.strip()
    if not word:
        return None
    if all(unicodedata.category(ch).startswith("P") for ch in word):
        return "punctuation"
    if not word.isalpha():
        return None
    lower = word.lower()
    if lower in INTERROGATIVES:
        return "interrogatives"
    if word[0].isupper() and (len(word) == 1 or word[1:].islower()):
        if lower in FUNCTION_WORDS or lower in DISCOURSE_MARKERS or (lower.endswith("ly") and len(lower) > 4):
            return "sentence_starters"
        return None
    if word.islower() and lower in FUNCTION_WORDS:
        return "function_words"
    return None


@functools.cache
def vocabulary() -> tuple[list[str], list[str | None]]:
    """(display strings, categories) of the real GPT-2 tokens 0..50256."""
    enc = gpt2_tokenizer()
    raw = [enc.decode_single_token_bytes(i) for i in range(GPT2_VOCAB)]
    return [b.decode("utf-8", errors="backslashreplace") for b in raw], [token_category(b) for b in raw]


def _null_distribution(d: int) -> tuple[np.ndarray, np.ndarray]:
    """(t, log P(cos ≤ t)) on [−1, 1] for the cosine between a fixed and a uniformly random direction in R^d.

    cos² ~ Beta(1/2, (d−1)/2): density (1 − t²)^((d−3)/2) / B(1/2, (d−1)/2); the tail is integrated numerically.
    """
    t = np.linspace(0.0, 1.0, 400_001)
    log_norm = math.lgamma(0.5) + math.lgamma((d - 1) / 2) - math.lgamma(d / 2)
    density = np.exp((d - 3) / 2 * np.log1p(-np.minimum(t, 1 - 1e-16) ** 2) - log_norm)
    steps = 0.5 * (density[1:] + density[:-1]) * np.diff(t)
    tail = np.concatenate([np.cumsum(steps[::-1])[::-1], [0.0]])  # P(cos > t), t ≥ 0
    full_t = np.concatenate([-t[:0:-1], t])
    log_cdf = np.concatenate([np.log(np.maximum(tail[:0:-1], 1e-300)), np.log1p(-np.minimum(tail, 1 - 1e-16))])
    return full_t, log_cdf


def null_threshold(d: int, vocab: int, quantile: float = NULL_QUANTILE) -> float:
    """The `quantile` of the maximum cosine between E[b_Q] and `vocab` random directions in R^d.

    A head whose top alignment exceeds it is aligned beyond chance at level 1 − quantile. For d = 64, V = 50257
    the 0.99 quantile is 0.58, the value the paper quotes (it equals the leading extreme-value term √(2 ln V / d));
    the expected maximum itself is lower (`expected_null_max`, 0.50).
    """
    t, log_cdf = _null_distribution(d)
    log_max_cdf = vocab * log_cdf
    return float(np.interp(math.log(quantile), log_max_cdf, t))


def expected_null_max(d: int, vocab: int) -> float:
    """E[max cosine] of `vocab` random directions with a fixed one in R^d: −1 + ∫ (1 − F(t)^V) dt."""
    t, log_cdf = _null_distribution(d)
    return float(-1.0 + np.trapezoid(-np.expm1(vocab * log_cdf), t))


def bias_direction(model: train_gpt.GPT) -> torch.Tensor:
    """E[b_Q] per layer and head, (L, H, d): the learned b_q in `learned` mode, else μ_Q·1 (all-ones if μ_Q = 0)."""
    cfg = model.config
    if cfg.bias_mode == "learned":
        return torch.stack([blk.attn.b_q.detach().expand(cfg.n_head, cfg.head_dim) for blk in model.transformer.h])
    return torch.full((cfg.n_layer, cfg.n_head, cfg.head_dim), cfg.mean_q if cfg.mean_q != 0 else 1.0)


@torch.no_grad()
def token_keys(model: train_gpt.GPT, mode: str, layer: int) -> torch.Tensor:
    """Keys (V, C) of every real token from its embedding in mode `raw`, else `ln`."""
    cfg = model.config
    block = model.transformer.h[layer]
    emb = model.transformer.wte.weight[:GPT2_VOCAB]
    w_k = block.attn.c_attn.weight[cfg.n_embd:2 * cfg.n_embd]
    if mode == "raw":
        return emb @ w_k.T
    return block.ln_1(emb) @ w_k.T + block.attn.c_attn.bias[cfg.n_embd:2 * cfg.n_embd]


class _KeysRecorded(Exception):
    """Raised by the last layer's hook: the rest of the forward pass (the LM head) is not needed."""


@torch.no_grad()
def residual_keys(model: train_gpt.GPT, files: str, num_tokens: int, seq_len: int, micro_batch: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer keys averaged per token id over the validation text: ((L, V, C) means, (V,) counts)."""
    cfg = model.config
    sums = torch.zeros(cfg.n_layer, GPT2_VOCAB, cfg.n_embd, dtype=torch.float64, device=device)
    counts = torch.zeros(GPT2_VOCAB, dtype=torch.float64, device=device)
    current: dict[str, torch.Tensor] = {}

    def hook(layer: int):
        def record(module, inputs, output):
            keys = output[..., cfg.n_embd:2 * cfg.n_embd].reshape(-1, cfg.n_embd).double()
            sums[layer].index_add_(0, current["ids"], keys)
            if layer == cfg.n_layer - 1:
                raise _KeysRecorded
        return record

    handles = [blk.attn.c_attn.register_forward_hook(hook(i)) for i, blk in enumerate(model.transformer.h)]
    try:
        for x, _, _ in validation_batches(files, micro_batch, seq_len, num_tokens, vocab_size=cfg.vocab_size,
                                          device=device):
            x = x.clamp_max(GPT2_VOCAB - 1)  # padding ids never occur in real text
            current["ids"] = x.reshape(-1)
            counts.index_add_(0, current["ids"], torch.ones_like(current["ids"], dtype=torch.float64))
            try:
                model(x)
            except _KeysRecorded:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return (sums / counts.clamp_min(1)[None, :, None]).float(), counts


def alignment_scores(keys: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """cos(k(x), E[b_Q]) per head: keys (V, H·d) and direction (H, d) → (H, V)."""
    heads, d = direction.shape
    return F.cosine_similarity(keys.view(-1, heads, d).float(), direction.float()[None], dim=-1).T


def enrichment(top: list[str | None], bottom: list[str | None]) -> dict[str, float]:
    """log2(f_top / f_bottom) per category with 0.5 pseudo-counts (finite when a category is absent from a list)."""
    out = {}
    for category in CATEGORIES:
        f_top = (sum(c == category for c in top) + PSEUDO_COUNT) / max(len(top), 1)
        f_bottom = (sum(c == category for c in bottom) + PSEUDO_COUNT) / max(len(bottom), 1)
        out[category] = math.log2(f_top / f_bottom)
    return out


def analyze(scores: torch.Tensor, token_ids: torch.Tensor, strings: list[str], categories: list[str | None],
            head_dim: int) -> dict:
    """Top/bottom tokens, alignment statistics and enrichment from cosines (L, H, V') over tokens `token_ids`."""
    n_layer, n_head, vocab = scores.shape
    threshold = null_threshold(head_dim, vocab)
    top_vals, top_idx = scores.topk(TOP_K, dim=-1)
    bottom_vals, bottom_idx = scores.topk(TOP_K, dim=-1, largest=False)
    heads, per_layer_top, per_layer_bottom = [], [], []
    for layer in range(n_layer):
        layer_top, layer_bottom = [], []
        for head in range(n_head):
            def entries(vals, idx):
                ids = token_ids[idx[layer, head]].tolist()
                return [{"id": i, "token": strings[i], "cos": float(v), "category": categories[i]}
                        for i, v in zip(ids, vals[layer, head].tolist())]
            top, bottom = entries(top_vals, top_idx), entries(bottom_vals, bottom_idx)
            layer_top += [e["category"] for e in top]
            layer_bottom += [e["category"] for e in bottom]
            heads.append({"layer": layer, "head": head, "top_alignment": top[0]["cos"], "top": top, "bottom": bottom})
        per_layer_top.append(layer_top)
        per_layer_bottom.append(layer_bottom)
    top_alignment = top_vals[..., 0]
    return {
        "vocab": vocab, "head_dim": head_dim, "null_threshold": threshold, "null_quantile": NULL_QUANTILE,
        "expected_null_max": expected_null_max(head_dim, vocab),
        "mean_top": float(top_alignment.mean()), "max_top": float(top_alignment.max()),
        "frac_above_null": float((top_alignment > threshold).double().mean()),
        "top_alignment": top_alignment.tolist(),
        "enrichment": {"pooled": enrichment(sum(per_layer_top, []), sum(per_layer_bottom, [])),
                       "per_layer": [enrichment(t, b) for t, b in zip(per_layer_top, per_layer_bottom)]},
        "heads": heads,
    }


def evaluate_alignment(model: train_gpt.GPT, mode: str, device: torch.device, files: str | None = None,
                       num_tokens: int = 262_144, seq_len: int = 512, micro_batch: int = 8) -> dict:
    """The full docs/evaluation.md#b_q-alignment-and-enrichment analysis of one model in one key mode (`files`: the
    validation shards that mode residual reads)."""
    strings, categories = vocabulary()
    cfg = model.config
    direction = bias_direction(model).to(device)
    if mode == "residual":
        means, counts = residual_keys(model, files, num_tokens, seq_len, micro_batch, device)
        token_ids = torch.nonzero(counts > 0).squeeze(1)
        keys = [means[layer, token_ids] for layer in range(cfg.n_layer)]
    else:
        token_ids = torch.arange(GPT2_VOCAB, device=device)
        keys = [token_keys(model, mode, layer) for layer in range(cfg.n_layer)]
    scores = torch.stack([alignment_scores(k, direction[layer]) for layer, k in enumerate(keys)]).cpu()
    return {"mode": mode, **analyze(scores, token_ids.cpu(), strings, categories, cfg.head_dim)}


MODE_WORDS = {"raw": "raw token embeddings through W_K (the paper's)",
              "ln": "token embeddings through the layer's LayerNorm and W_K, with the key bias",
              "residual": "the residual stream's keys on validation text, averaged per token"}


def alignment_figure(result: dict, title: str = ""):
    """Layer × head heatmap of the top alignment (null threshold marked) and enrichment bars (pooled and every
    layer, each in the legend)."""
    plt = pyplot()
    fig, (ax_map, ax_bar) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.3]})
    top = np.array(result["top_alignment"])
    image = ax_map.imshow(top, cmap="viridis", vmin=min(0.0, top.min()), vmax=1.0, aspect="auto")
    for (layer, head), value in np.ndenumerate(top):
        if value > result["null_threshold"]:
            ax_map.text(head, layer, "•", ha="center", va="center", color="white", fontsize=7)
    ax_map.set_xticks(range(top.shape[1]))
    ax_map.set_yticks(range(top.shape[0]))
    ax_map.set_xlabel("head")
    ax_map.set_ylabel("layer")
    ax_map.set_title(f"top cos(k, E[b_Q]) per head; • above the null threshold {result['null_threshold']:.2f}",
                     fontsize=9)
    fig.colorbar(image, ax=ax_map)
    per_layer = result["enrichment"]["per_layer"]
    width = 0.8 / (len(per_layer) + 1)
    for j, category in enumerate(CATEGORIES):
        ax_bar.bar(j - 0.4, result["enrichment"]["pooled"][category], width=width * 1.5, color="black",
                   label="pooled over layers" if j == 0 else None, align="edge")
        for layer, values in enumerate(per_layer):
            ax_bar.bar(j - 0.4 + width * (layer + 1.5), values[category], width=width,
                       color=plt.cm.coolwarm(layer / max(len(per_layer) - 1, 1)), align="edge",
                       label=f"layer {layer}" if j == 0 else None)
    ax_bar.axhline(0, color="gray", lw=0.8)
    ax_bar.set_xticks(range(len(CATEGORIES)), [c.replace("_", "\n") for c in CATEGORIES], fontsize=8)
    ax_bar.set_ylabel("log2 enrichment (top / bottom)")
    ax_bar.set_title("semantic enrichment of the most aligned tokens")
    ax_bar.legend(fontsize=7, ncol=1 + len(per_layer) // 8)
    fig.suptitle(f"{title} — keys: {MODE_WORDS.get(result['mode'], result['mode'])}")
    fig.tight_layout()
    return fig


def markdown_summary(results: list[dict], title: str) -> str:
    lines = [f"# b_Q alignment — {title}", "",
             "cos(k(x), E[b_Q]) per head (docs/evaluation.md). Null threshold: the 99% quantile of the maximum of V "
             "random cosines in d dims.", ""]
    rows = [[r["mode"], r["vocab"], f"{r['mean_top']:.3f}", f"{r['max_top']:.3f}", f"{r['null_threshold']:.3f}",
             f"{100 * r['frac_above_null']:.1f}"] for r in results]
    lines += [markdown_table(["keys", "tokens", "mean top", "max top", "null", "% heads > null"], rows), ""]
    rows = [[c] + [f"{r['enrichment']['pooled'][c]:+.2f}" for r in results] for c in CATEGORIES]
    lines += ["## Enrichment (log2 top/bottom, pooled over layers)", "",
              markdown_table(["category"] + [r["mode"] for r in results], rows), ""]
    for r in results:
        lines += [f"![alignment {r['mode']}](alignment_{r['mode']}.png)", ""]
        for h in sorted(r["heads"], key=lambda h: -h["top_alignment"])[:2]:  # the two most aligned heads
            rows = [[t["token"], f"{t['cos']:+.3f}", b["token"], f"{b['cos']:+.3f}"]
                    for t, b in zip(h["top"], h["bottom"])]
            lines += [f"### {r['mode']}: layer {h['layer']} head {h['head']}", "",
                      markdown_table(["top token", "cos", "bottom token", "cos"], rows[:10]), ""]
    return "\n".join(lines)


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(module="eval.alignment", description=__doc__)
    add_target_args(parser)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="alignment modes to compute (docs/evaluation.md#b_q-alignment-and-enrichment)")
    parser.add_argument("--val-files", default=None,
                        help="text for mode residual (default: the run's validation files)")
    parser.add_argument("--residual-tokens", type=int, default=262_144, help="tokens of text for mode residual")
    args = parser.parse_args(argv)
    target = open_target(args)
    run_dir, ckpt, out, device = target.run_dir, target.checkpoint, target.out, target.device
    step = target.identity["step"]
    model = train_gpt.model_from_checkpoint(ckpt).to(device)
    if model.config.attention != "standard":
        raise SystemExit(f"error: {target.checkpoint_path} has --attention {model.config.attention}: b_Q alignment "
                         "needs the keys of standard attention")
    hp = run_hyperparameters(ckpt["config"])
    seq_len = min(hp.seq_len, model.config.block_size)
    files, residual_tokens = None, args.residual_tokens
    if "residual" in args.modes:
        files = args.val_files or validation_files(ckpt["config"])
        available = validation_capacity(files, seq_len)
        if available < residual_tokens:
            print(f"residual: the validation shards hold {available:,} tokens in whole sequences of {seq_len} + 1; "
                  f"using them all instead of --residual-tokens {residual_tokens:,}")
            residual_tokens = available
    results = []
    for mode in args.modes:
        result = evaluate_alignment(model, mode, device, files, residual_tokens, seq_len, hp.micro_batch)
        save_figure(alignment_figure(result, f"{run_dir.name} — step {step}"), out / f"alignment_{mode}.png")
        results.append(result)
        print(f"{mode}: mean top {result['mean_top']:.3f}  max {result['max_top']:.3f}  "
              f"{100 * result['frac_above_null']:.1f}% heads > {result['null_threshold']:.3f}  punctuation "
              f"{result['enrichment']['pooled']['punctuation']:+.2f}")
    summary = {"checkpoint": target.identity, "step": step, "bias_mode": model.config.bias_mode,
               "modes": {r["mode"]: r for r in results}}
    write_json(out / "alignment.json", summary)
    atomic_write(out / "alignment.md", markdown_summary(results, f"{run_dir.name}, step {step}").encode())
    record_outputs(out, "alignment", target.identity,
                   ["alignment.json", "alignment.md"] + [f"alignment_{mode}.png" for mode in args.modes])
    return summary


if __name__ == "__main__":
    main()
