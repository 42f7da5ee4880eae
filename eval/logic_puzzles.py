"""Logic puzzles (arXiv 2601.22257 App. E.1; docs/evaluation.md): is the expected first token in the model's
top-1 / top-5, and its cross-entropy ("logic loss"), per category and overall, with 95% intervals.

    python -m eval.logic_puzzles --run runs/NAME [--suite my_suite.json ...] [--per-category 250] [--seed 0]
    python -m eval.logic_puzzles --run runs/NAME --protocol paper     # the paper's 14 items, scored its way

Suites are JSON files {"name", "protocol"?, "items": [{"id", "category", "prompt", "expected"}]}. Built in: `fixed`
(eval/suites/logic_fixed.json, our hand-written items), `paper` (eval/suites/logic_paper.json, the paper's 14 items)
and a generated suite (`generate_suite`: templates with random names, items, sequences and distractor sentences,
reproducible from the seed; it is also written to the output directory). Two scoring protocols (PROTOCOLS):
  ours (default): each prompt is preceded by <|endoftext|> (a document start, as in training), the distribution is
      taken over the 50257 real GPT-2 tokens (padding ids excluded), and `expected` must be one token;
  paper: the published evaluation's: the prompt alone, the distribution over every logit of the model (50304 with
      padding), and a multi-token answer scored by its first token.
A suite is scored with its own "protocol" (default ours) unless --protocol says otherwise. Symmetry-broken models
run with the mean biases (docs/model.md). Intervals: Wilson for accuracies, normal for the mean loss.
Writes `logic_puzzles.json`, `logic_puzzles.png`, `logic_puzzles.md`, recorded with the checkpoint in `manifest.json`.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from cli import ArgumentParser
import train_gpt
from data.shards import EOT_TOKEN, GPT2_VOCAB
from data.tokenizer import gpt2_tokenizer
from eval.figures import error_bars, pyplot, save_figure
from eval.outputs import markdown_table, record_outputs, write_json
from eval.samples import mean_interval, wilson_interval
from eval.target import add_target_args, open_target
from fileio import atomic_write, exits_on_filesystem_errors

CATEGORIES = ("pattern_numeric", "pattern_alpha", "retrieval_near", "retrieval_far", "simple_inference", "copy")
SUITES_DIR = Path(__file__).resolve().parent / "suites"
FIXED_SUITE = SUITES_DIR / "logic_fixed.json"
PAPER_SUITE = SUITES_DIR / "logic_paper.json"  # the paper's 14 items, from its published code
BUILTIN_SUITES = {"fixed": FIXED_SUITE, "paper": PAPER_SUITE}


@dataclass(frozen=True)
class Protocol:
    """How a prompt is fed and its answer scored (docs/evaluation.md#scoring-protocols)."""

    document_start: bool  # precede the prompt with <|endoftext|>
    real_tokens_only: bool  # rank and normalise over the 50257 GPT-2 tokens, not the padded vocabulary
    first_token_of_answer: bool  # score a multi-token answer by its first token (else refuse it)


PROTOCOLS = {
    "ours": Protocol(document_start=True, real_tokens_only=True, first_token_of_answer=False),
    "paper": Protocol(document_start=False, real_tokens_only=False, first_token_of_answer=True),
}

# Word pools for the generated suite; every entry is one GPT-2 token with a leading space (tests check this).
NAMES = ("Alice Bob Carol Dave Emma Frank Grace Henry Jack Kate Leo Mary Nick Olivia Paul Rose Sam Tom Anna Ben "
         "Lucy Mark Sarah John David Laura Peter Susan James Linda").split()
ITEMS = "apples bananas grapes bread cheese rice soup tea coffee milk juice water books pens cars hats shoes".split()
ATTRIBUTES = {
    "color": "red blue green yellow black white pink brown orange purple gray".split(),
    "shape": "round square flat long short tall thin thick small large".split(),
    "pet": "cat dog horse bird fish cow pig sheep goat mouse rabbit duck frog".split(),
    "city": "Paris London Tokyo Berlin Rome Madrid Moscow Cairo Delhi Boston Chicago Dublin Vienna Prague".split(),
}
OBJECTS = "car house door box bag boat kite book cup lamp".split()
VERBS = ("likes", "has", "wants", "owns", "sees")
EFFECTS = {"studies": "pass", "trains": "win", "is tired": "sleep", "hears a joke": "laugh", "is cold": "wait",
           "is hungry": "eat", "is sad": "cry", "hears music": "dance", "is bored": "leave", "is sick": "rest"}
KINDS = {"cats": "cat", "birds": "bird", "dogs": "dog", "teachers": "teacher", "doctors": "doctor",
         "farmers": "farmer", "students": "student", "kings": "king"}
ADJECTIVES = "mortal happy tall kind brave quiet clever strong young friendly".split()
WORDS = ("apple river stone cloud tree house bird light music paper glass water table chair window garden moon star "
         "road book door dream fire snow rain sand wind ship king song").split()
FILLERS = ("It was a sunny day.", "The shop opens at nine.", "Nobody said a word.", "The train was on time.",
           "We walked to the park.", "The soup was hot.", "It started to rain.", "The radio was playing.")
NUMERIC_MAX = 300  # " 0" .. " 361" are single GPT-2 tokens


def _numeric(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(("up", "down", "double", "fibonacci", "squares"))
    if kind in ("up", "down"):  # a falling sequence is a rising one read backwards (the same draws)
        step, n = rng.randint(1, 9), rng.randint(4, 6)
        start = rng.randint(0, NUMERIC_MAX - step * n)
        seq = [start + step * i for i in range(n + 1)][::1 if kind == "up" else -1]
    elif kind == "double":
        start, n = rng.randint(1, 9), rng.randint(3, 5)
        seq = [start * 2 ** i for i in range(n + 1)]
    elif kind == "fibonacci":
        seq = [rng.randint(1, 5), rng.randint(1, 5)]
        while len(seq) < rng.randint(6, 8):
            seq.append(seq[-1] + seq[-2])
    else:
        first = rng.randint(1, 6)
        seq = [(first + i) ** 2 for i in range(rng.randint(4, 5) + 1)]
    prefix = rng.choice(("", "Continue the sequence: ", "Numbers: ", f"{rng.choice(FILLERS)} "))
    return prefix + ", ".join(map(str, seq[:-1])) + ",", f" {seq[-1]}"


def _alpha(rng: random.Random) -> tuple[str, str]:
    step, n = rng.choice((1, 1, 2)), rng.randint(3, 5)
    start = rng.randrange(26)
    letters = [(start + step * i) % 26 for i in range(n + 1)]  # wraps around Z -> A
    base = rng.choice((65, 97))
    seq = [chr(base + i) for i in letters]
    prefix = rng.choice(("", "Letters: ", "Continue: "))
    return prefix + ", ".join(seq[:-1]) + ",", f" {seq[-1]}"


def _facts(rng: random.Random, count: int) -> list[tuple[str, str, str]]:
    """`count` (subject, verb phrase, value) facts with distinct subjects and values."""
    if rng.random() < 0.5:
        names, items, verb = rng.sample(NAMES, count), rng.sample(ITEMS, count), rng.choice(VERBS)
        return [(name, verb, item) for name, item in zip(names, items)]
    attribute = rng.choice(sorted(ATTRIBUTES))
    objects, values = rng.sample(OBJECTS, count), rng.sample(ATTRIBUTES[attribute], count)
    return [(f"The {obj}", "is", value) for obj, value in zip(objects, values)]


def _retrieval(rng: random.Random, far: bool) -> tuple[str, str]:
    facts = _facts(rng, rng.randint(4, 6) if far else rng.randint(2, 3))
    target = facts[0] if far else facts[-rng.randint(1, 2)]
    sentences = [f"{s} {v} {x}." for s, v, x in facts]
    if far:  # distractor sentences between the fact and the question
        sentences += rng.sample(FILLERS, rng.randint(0, 2))
    return " ".join(sentences) + f" {target[0]} {target[1]}", f" {target[2]}"


def _inference(rng: random.Random) -> tuple[str, str]:
    name, other = rng.sample(NAMES, 2)
    distractor = f"{other} is a {rng.choice(list(KINDS.values()))}. " if rng.random() < 0.5 else ""
    if rng.random() < 0.5:
        condition = rng.choice(sorted(EFFECTS))
        effect = EFFECTS[condition]
        prompt = (f"If {name} {condition}, {name} will {effect}. {distractor}{name} {condition}. "
                  f"{rng.choice(('So', 'Therefore,'))} {name} will")
        return prompt, f" {effect}"
    plural = rng.choice(sorted(KINDS))
    adjective = rng.choice(ADJECTIVES)
    prompt = (f"All {plural} are {adjective}. {distractor}{name} is a {KINDS[plural]}. "
              f"{rng.choice(('So', 'Therefore,'))} {name} is")
    return prompt, f" {adjective}"


def _copy(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(4, 6)
    kind = rng.choice(("words", "digits", "letters"))
    if kind == "words":
        seq = rng.sample(WORDS, n)
    elif kind == "digits":
        seq = [str(rng.randint(0, 9)) for _ in range(n)]
    else:
        seq = [chr(65 + rng.randrange(26)) for _ in range(n)]
    intro, again = rng.choice((("Repeat after me:", "Again:"), ("Copy:", "Copy:"), ("Say:", "Once more:")))
    return f"{intro} {' '.join(seq)}. {again} {' '.join(seq[:-1])}", f" {seq[-1]}"


GENERATORS = {
    "pattern_numeric": _numeric,
    "pattern_alpha": _alpha,
    "retrieval_near": lambda rng: _retrieval(rng, far=False),
    "retrieval_far": lambda rng: _retrieval(rng, far=True),
    "simple_inference": _inference,
    "copy": _copy,
}


def generate_suite(seed: int = 0, per_category: int = 250) -> dict:
    """A generated suite: `per_category` distinct prompts per category, identical for the same seed."""
    items = []
    for category in CATEGORIES:
        rng = random.Random(f"{seed}-{category}")
        seen: set[str] = set()
        for _ in range(100 * per_category):
            if len(seen) == per_category:
                break
            prompt, expected = GENERATORS[category](rng)
            if prompt not in seen:
                seen.add(prompt)
                items.append({"id": f"{category}-{len(seen) - 1}", "category": category, "prompt": prompt,
                              "expected": expected})
        if len(seen) < per_category:
            raise ValueError(f"generate_suite: only {len(seen)} distinct {category} prompts; lower --per-category")
    return {"name": f"generated-seed{seed}", "seed": seed, "items": items}


def load_suite(path: str | Path) -> dict:
    """Read and validate a suite file (schema above)."""
    path = Path(path)
    try:
        suite = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--suite {path}: cannot read a JSON suite ({e})") from e
    items = suite.get("items") if isinstance(suite, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError(f"--suite {path}: expected an object with a non-empty 'items' list")
    if suite.get("protocol", "ours") not in PROTOCOLS:
        raise ValueError(f"--suite {path}: protocol {suite['protocol']!r} is not one of {', '.join(PROTOCOLS)}")
    for i, item in enumerate(items):
        missing = {"category", "prompt", "expected"} - set(item)
        if missing:
            raise ValueError(f"--suite {path}: item {i} lacks {sorted(missing)}")
    suite.setdefault("name", path.stem)
    return suite


def encode_items(items: list[dict], enc: tiktoken.Encoding, suite_name: str = "suite",
                 protocol: str = "ours") -> list[tuple[list[int], int]]:
    """(prompt tokens, expected token id) per item under `protocol` (PROTOCOLS): ours puts <|endoftext|> first and
    needs a one-token answer; paper takes the prompt alone and the answer's first token."""
    rules = PROTOCOLS[protocol]
    encoded = []
    for item in items:
        expected = enc.encode(item["expected"])
        if len(expected) != 1 and not (rules.first_token_of_answer and expected):
            raise ValueError(f"{suite_name}: item {item.get('id', item['prompt'][:30])!r}: expected answer "
                             f"{item['expected']!r} is {len(expected)} GPT-2 tokens; use a single token (the "
                             "answer's first one), or --protocol paper, which scores an answer by its first token")
        prompt = enc.encode(item["prompt"])
        if not prompt and not rules.document_start:
            raise ValueError(f"{suite_name}: item {item.get('id', '')!r} has an empty prompt")
        encoded.append((([EOT_TOKEN] if rules.document_start else []) + prompt, expected[0]))
    return encoded


@torch.no_grad()
def score_items(model: train_gpt.GPT, encoded: list[tuple[list[int], int]], device: torch.device,
                batch_size: int = 32, protocol: str = "ours") -> list[dict]:
    """Rank (1 = top-1), log-probability and top-5 ids of the expected token after each prompt, over the
    vocabulary of `protocol` (ours: the 50257 real tokens; paper: every logit)."""
    vocabulary = GPT2_VOCAB if PROTOCOLS[protocol].real_tokens_only else None
    model.eval()
    block = model.config.block_size
    results = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start:start + batch_size]
        longest = max(len(tokens) for tokens, _ in chunk)
        if longest > block:
            raise ValueError(f"a prompt of {longest} tokens exceeds the model's block_size {block}")
        idx = pad_sequence([torch.tensor(tokens) for tokens, _ in chunk], batch_first=True, padding_value=EOT_TOKEN)
        logits, _ = model(idx.to(device), all_logits=True)  # each prompt ends at its own position
        last = torch.tensor([len(tokens) - 1 for tokens, _ in chunk], device=device)
        final = logits[torch.arange(len(chunk), device=device), last, :vocabulary].float()
        logp = F.log_softmax(final, dim=-1)
        expected = torch.tensor([target for _, target in chunk], device=device)
        target_logp = logp.gather(1, expected[:, None]).squeeze(1)
        ranks = (logp > target_logp[:, None]).sum(dim=1) + 1
        top5 = logp.topk(5, dim=-1).indices
        for row in range(len(chunk)):
            results.append({"rank": int(ranks[row]), "logprob": float(target_logp[row]), "top5": top5[row].tolist()})
    return results


def summarize(items: list[dict], scores: list[dict]) -> dict:
    """top1 / top5 (with Wilson 95% CI) and logic loss (with normal 95% CI), overall and per category."""
    def block(rows: list[dict]) -> dict:
        n = len(rows)
        top1 = sum(r["rank"] == 1 for r in rows)
        top5 = sum(r["rank"] <= 5 for r in rows)
        loss, loss_lo, loss_hi = mean_interval([-r["logprob"] for r in rows])
        return {"n": n, "top1": top1 / n, "top1_ci": wilson_interval(top1, n), "top5": top5 / n,
                "top5_ci": wilson_interval(top5, n), "logic_loss": loss, "logic_loss_ci": (loss_lo, loss_hi)}
    categories = {category: block([s for item, s in zip(items, scores) if item["category"] == category])
                  for category in dict.fromkeys(item["category"] for item in items)}
    overall = block(scores)
    overall["top5_category_mean"] = sum(c["top5"] for c in categories.values()) / len(categories)
    overall["top1_category_mean"] = sum(c["top1"] for c in categories.values()) / len(categories)
    return {"overall": overall, "categories": categories}


def evaluate_suite(model: train_gpt.GPT, suite: dict, device: torch.device, batch_size: int = 32,
                   protocol: str | None = None) -> dict:
    """Score one suite under `protocol` (None: the suite's own, default ours): summary plus per-item results
    (prompt, expected, rank, log-prob, top-5 tokens; a padding id shows as <padding N>)."""
    protocol = protocol or suite.get("protocol", "ours")
    enc = gpt2_tokenizer()
    encoded = encode_items(suite["items"], enc, suite["name"], protocol)
    scores = score_items(model, encoded, device, batch_size, protocol)
    details = [{"id": item.get("id"), "category": item["category"], "prompt": item["prompt"],
                "expected": item["expected"], "rank": s["rank"], "logprob": s["logprob"],
                "top5": [enc.decode([t]) if t < enc.n_vocab else f"<padding {t}>" for t in s["top5"]]}
               for item, s in zip(suite["items"], scores)]
    return {"name": suite["name"], "protocol": protocol, **summarize(suite["items"], scores), "items": details}


def plot_suites(results: list[dict], path: Path, title: str = "") -> None:
    """Per-category top-1 / top-5 bars with 95% Wilson intervals, one panel per suite."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.2), squeeze=False)
    for ax, result in zip(axes[0], results):
        names = list(result["categories"]) + ["overall"]
        blocks = list(result["categories"].values()) + [result["overall"]]
        for offset, metric in ((-0.2, "top1"), (0.2, "top5")):
            values = [b[metric] * 100 for b in blocks]
            errors = error_bars(values, [(100 * b[f"{metric}_ci"][0], 100 * b[f"{metric}_ci"][1]) for b in blocks])
            ax.bar([i + offset for i in range(len(names))], values, width=0.4, yerr=errors, capsize=3,
                   label={"top1": "expected token ranked first", "top5": "expected token in the top 5"}[metric])
        ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"suite {result['name']}: {result['overall']['n']} prompts, {result['protocol']} scoring protocol")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)


def _percent_with_ci(block: dict, metric: str) -> str:
    low, high = block[f"{metric}_ci"]
    return f"{100 * block[metric]:.1f} [{100 * low:.0f}, {100 * high:.0f}]"


def markdown_summary(results: list[dict], title: str, step: int | None = None) -> str:
    lines = [f"# Logic puzzles — {title}, step {step}", "",
             "Expected first token in top-1 / top-5 and its cross-entropy (logic loss); 95% intervals in brackets "
             "(docs/evaluation.md#logic-puzzles).", ""]
    for r in results:
        rows = [[name, b["n"], _percent_with_ci(b, "top1"), _percent_with_ci(b, "top5"), f"{b['logic_loss']:.3f}"]
                for name, b in [*r["categories"].items(), ("**overall**", r["overall"])]]
        lines += [f"## Suite `{r['name']}` (protocol `{r['protocol']}`)", "",
                  markdown_table(["category", "n", "top-1 %", "top-5 %", "logic loss"], rows),
                  f"Mean of the per-category accuracies: top-1 {100 * r['overall']['top1_category_mean']:.1f}%, "
                  f"top-5 {100 * r['overall']['top5_category_mean']:.1f}%.", ""]
    return "\n".join(lines + ["![logic puzzles](logic_puzzles.png)", ""])


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(module="eval.logic_puzzles", description=__doc__)
    add_target_args(parser)
    parser.add_argument("--suite", action="append", default=None,
                        help="suite JSON file, or a built-in suite: fixed, paper (repeatable; default: fixed, or "
                             "paper with --protocol paper; a generated suite is added unless --no-generated)")
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default=None,
                        help="scoring protocol for every suite (default: each suite's own, ours unless the suite "
                             "says otherwise): ours or paper (docs/evaluation.md#scoring-protocols)")
    parser.add_argument("--per-category", type=int, default=250, help="generated prompts per category")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated suite")
    parser.add_argument("--no-generated", action="store_true", help="skip the generated suite")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per forward pass")
    args = parser.parse_args(argv)
    target = open_target(args)
    run_dir, ckpt, out, device = target.run_dir, target.checkpoint, target.out, target.device
    model = train_gpt.model_from_checkpoint(ckpt).to(device)
    default = "paper" if args.protocol == "paper" else "fixed"
    suites = [load_suite(BUILTIN_SUITES.get(name, name)) for name in (args.suite or [default])]
    if not args.no_generated:
        generated = generate_suite(args.seed, args.per_category)
        write_json(out / "logic_generated_suite.json", generated)
        suites.append(generated)
    results = [evaluate_suite(model, suite, device, args.batch_size, args.protocol) for suite in suites]
    summary = {"checkpoint": target.identity, "step": target.identity["step"], "suites": results}
    write_json(out / "logic_puzzles.json", summary)
    plot_suites(results, out / "logic_puzzles.png", title=f"{run_dir.name} — step {summary['step']}")
    atomic_write(out / "logic_puzzles.md", markdown_summary(results, run_dir.name, summary["step"]).encode())
    record_outputs(out, "logic_puzzles", target.identity, ["logic_puzzles.json", "logic_puzzles.png",
                                                           "logic_puzzles.md"]
                   + ([] if args.no_generated else ["logic_generated_suite.json"]))
    for r in results:
        o = r["overall"]
        print(f"{r['name']} ({r['protocol']}): top-1 {100 * o['top1']:.1f}%  top-5 {100 * o['top5']:.1f}%  "
              f"(category mean {100 * o['top5_category_mean']:.1f}%)  logic loss {o['logic_loss']:.3f}  (n={o['n']})")
    return summary


if __name__ == "__main__":
    main()
