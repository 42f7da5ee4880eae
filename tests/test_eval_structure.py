"""Symmetry and directionality scores of W_QK (eval.structure): limits, planted structure, conventions, the CLI."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from eval import structure
from eval.structure import directionality_score, query_key_matrices, symmetry_score
from gauge.dynamics import plain_name
from run.checkpoint import load_checkpoint
from tests.helpers import tiny_gpt, train_tiny_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def random_matrix(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("convention, sym, skew", [("figures", 1.0, -1.0), ("paper", 1.0, -1.0),
                                                   ("published", 1.0, 0.0)])
def test_symmetry_score_of_symmetric_and_skew_matrices(convention, sym, skew):
    m = random_matrix(50, 0)
    assert symmetry_score(m + m.T, convention).item() == pytest.approx(sym, abs=1e-12)
    assert symmetry_score(m - m.T, convention).item() == pytest.approx(skew, abs=1e-12)
    s = symmetry_score(m, "paper").item()  # published = (paper + 1) / 2 on the same matrix; figures = paper
    assert symmetry_score(m, "published").item() == pytest.approx((s + 1) / 2, abs=1e-12)
    assert symmetry_score(m, "figures").item() == s


def test_scores_of_large_random_matrices_are_near_zero():
    assert abs(symmetry_score(random_matrix(400, 1)).item()) < 0.02
    assert symmetry_score(random_matrix(400, 1), "published").item() == pytest.approx(0.5, abs=0.01)
    # One random matrix's directionality depends on which few norms pass the threshold (it can be ±1 when only rows
    # or only columns do); its mean over matrices is 0.
    batch = torch.stack([random_matrix(200, seed) for seed in range(40)])
    for convention in structure.CONVENTIONS:
        scores = directionality_score(batch, convention)
        assert scores.abs().max() <= 1 and abs(scores.mean().item()) < 0.1, convention


@pytest.mark.parametrize("dominant", ["row", "column"])
@pytest.mark.parametrize("seed", range(4))
def test_directionality_detects_planted_dominance_with_each_conventions_sign(dominant, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(100, 100, generator=g, dtype=torch.float64)
    m[[3, 17]] = 4.0 * torch.randn(2, 100, generator=g, dtype=torch.float64).sign()  # two rows of norm 40 (vs ~10)
    if dominant == "column":
        m = m.T
    scores = {convention: directionality_score(m, convention).item() for convention in structure.CONVENTIONS}
    paper, published, figures = scores["paper"], scores["published"], scores["figures"]
    sign = 1.0 if dominant == "row" else -1.0
    # figures and paper: rows dominate -> positive. paper sums whole norms, so the columns just above their
    # threshold weigh in too (margin 0.2); figures and published sum only the excess over the threshold, with
    # opposite signs.
    assert sign * figures > 0.9
    assert sign * paper > 0.2
    assert published == -figures
    assert directionality_score(m.T, "paper").item() == pytest.approx(-paper)
    # Symmetric structure has no direction: planting the same rows and columns cancels.
    both = random_matrix(100, seed)
    both[[5, 9]] *= 8.0
    both[:, [5, 9]] *= 8.0
    assert abs(directionality_score(both).item()) < 0.1


def test_each_convention_gives_the_closed_form_scores_of_planted_rank_one_matrices():
    """M = u vᵀ (16×16): row i has norm |u_i|·‖v‖ and column j |v_j|·‖u‖. With one outlier b among 15 values a,
    mean + 2·std (unbiased) is a + (b − a)(1/16 + 2/4), so exactly the outlier passes, with excess
    (b − a)·7/16; and s = cos²(u, v). Row outlier 4 among 1s, column outlier 2 among 1s (signs do not matter)."""
    n, row_out, col_out = 16, 4.0, 2.0
    g = torch.Generator().manual_seed(0)
    u = torch.ones(n, dtype=torch.float64)
    v = torch.ones(n, dtype=torch.float64)
    u[3], v[5] = row_out, col_out
    u, v = u * torch.randn(n, generator=g, dtype=torch.float64).sign(), v * torch.randn(
        n, generator=g, dtype=torch.float64).sign()
    norm_u, norm_v = math.sqrt(15 + row_out ** 2), math.sqrt(15 + col_out ** 2)
    fraction_above = 1 - (1 / n + 2 / math.sqrt(n))  # (b − threshold)/(b − a) = 7/16
    rows_whole, cols_whole = row_out * norm_v, col_out * norm_u
    rows_excess, cols_excess = fraction_above * (row_out - 1) * norm_v, fraction_above * (col_out - 1) * norm_u
    cos2 = float(u @ v) ** 2 / (norm_u ** 2 * norm_v ** 2)
    expected = {
        "figures": (cos2, (rows_excess - cols_excess) / (rows_excess + cols_excess)),
        "paper": (cos2, (rows_whole - cols_whole) / (rows_whole + cols_whole)),
        "published": ((1 + cos2) / 2, (cols_excess - rows_excess) / (cols_excess + rows_excess)),
    }
    assert expected["figures"][1] == pytest.approx(0.4027, abs=1e-4)  # the numbers differ between conventions
    assert expected["paper"][1] == pytest.approx(0.2205, abs=1e-4)
    m = torch.outer(u, v)
    for convention, (sym, direction) in expected.items():
        assert symmetry_score(m, convention).item() == pytest.approx(sym, abs=1e-12), convention
        assert directionality_score(m, convention).item() == pytest.approx(direction, abs=1e-12), convention
        # Transposing swaps rows and columns: the directionality changes sign, the symmetry does not.
        assert directionality_score(m.T, convention).item() == pytest.approx(-direction, abs=1e-12), convention
        assert symmetry_score(m.T, convention).item() == pytest.approx(sym, abs=1e-12), convention


def test_zero_matrix_and_bad_convention():
    zero = torch.zeros(4, 4)
    assert symmetry_score(zero).item() == 0.0 and directionality_score(zero).item() == 0.0
    with pytest.raises(ValueError, match="convention"):
        symmetry_score(zero, "other")


def test_query_key_matrix_orientation_and_head_sum():
    model = tiny_gpt(0, block_size=16, n_layer=1)
    tensors = {plain_name(n): p.detach() for n, p in model.named_parameters()}
    m, per_head = query_key_matrices(tensors, 0, n_head=2)
    w_q, w_k, _ = tensors["transformer.h.0.attn.c_attn.weight"].double().split(32)
    torch.testing.assert_close(m, w_q.T @ w_k)  # x M yᵀ = (x W_Qᵀ)·(y W_Kᵀ): rows query side, columns key side
    torch.testing.assert_close(per_head.sum(0), m)
    torch.testing.assert_close(per_head[1], w_q[16:].T @ w_k[16:])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 4-step run of a tiny model with checkpoints at steps 2 and 4 (step_*.pt and latest.pt)."""
    return train_tiny_run(tmp_path_factory.mktemp("structure"), "--log-every", "2", "--checkpoint-every", "2",
                          "--keep-checkpoints", "-1")


def test_cli_over_a_runs_checkpoints(tiny_run, tmp_path):
    for convention in structure.CONVENTIONS:
        summary = structure.main(["--run", str(tiny_run), "--convention", convention, "--out", str(tmp_path)])
        stem = tmp_path / f"structure_{convention}"
        saved = json.loads(stem.with_suffix(".json").read_text())
        assert [c["step"] for c in saved["checkpoints"]] == [2, 4]  # latest.pt duplicates step 4
        assert stem.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
        assert stem.with_suffix(".md").read_text().startswith("# W_QK structure")
        last = summary["checkpoints"][-1]
        assert len(last["layers"]["symmetry"]) == 2 and len(last["heads"]["directionality"][0]) == 2
        assert last["median"]["symmetry"] == pytest.approx(float(np.median(last["layers"]["symmetry"])))
    ckpt = load_checkpoint(tiny_run / "checkpoints" / "latest.pt")
    tensors = {plain_name(n): t for n, t in ckpt["model"].items()}
    expected = symmetry_score(query_key_matrices(tensors, 1, 2)[0], "published").item()
    assert saved["checkpoints"][-1]["layers"]["symmetry"][1] == pytest.approx(expected)
    one = structure.main(["--checkpoint", str(tiny_run / "checkpoints" / "step_000002.pt"), "--out", str(tmp_path)])
    assert [c["step"] for c in one["checkpoints"]] == [2]
    assert one["convention"] == "figures"  # the default: the sign and scale of the paper's figures
