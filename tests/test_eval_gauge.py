"""Gauge-sensitivity diagnostic (eval.gauge): exact gauges, rotation equivariance of plain GD, the sensitivity of
AdamW and of GL(d) gauges, the forward-pass check, the CLI and the trainer's --gauge-diagnostic-every."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import train_gpt
from eval import gauge
from gauge import sensitivity
from optim.torch_optimizers import AdamWConfig, SGDMConfig
from run.log import read_log
from tests.helpers import tiny_gpt, train_tiny_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLAIN_GD = SGDMConfig(lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0, fused=False)
ADAMW = AdamWConfig(lr=1e-3, weight_decay=0.0, fused=False)


def tiny_model(**overrides) -> train_gpt.GPT:
    return tiny_gpt(**{"block_size": 16, "bias_mode": "none", **overrides})


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def test_random_gauges_have_the_requested_condition_number():
    g = torch.Generator().manual_seed(0)
    rotations = sensitivity.random_gauges((3, 2), 8, "orthogonal", 1.0, g)
    torch.testing.assert_close(rotations.mT @ rotations, torch.eye(8, dtype=torch.float64).expand(3, 2, 8, 8))
    general = sensitivity.random_gauges((3, 2), 8, "gl", 25.0, g)
    singular = torch.linalg.svdvals(general)
    torch.testing.assert_close(singular[..., 0] / singular[..., -1], torch.full((3, 2), 25.0, dtype=torch.float64))
    torch.testing.assert_close(torch.linalg.det(general).abs(), torch.ones(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="gauge kind"):
        sensitivity.random_gauges((1,), 4, "unitary", 1.0, g)


def test_plain_gd_is_rotation_equivariant():
    x, y = batch()
    result = sensitivity.gauge_diagnostic(tiny_model(), "sgdm", PLAIN_GD, x, y, kind="orthogonal", samples=3)
    assert max(result["logit_change"]) < 1e-12
    for sector in gauge.SECTORS:
        assert result["summary"][f"relative_difference_{sector}"] < 1e-9, sector
        assert result["summary"][f"random_gauge_variance_{sector}"] < 1e-18, sector


def test_adamw_and_gl_gauges_see_the_representative():
    x, y = batch()
    adamw = sensitivity.gauge_diagnostic(tiny_model(), "adamw", ADAMW, x, y, kind="orthogonal", samples=3)
    gd_gl = sensitivity.gauge_diagnostic(tiny_model(), "sgdm", PLAIN_GD, x, y, kind="gl", condition=10.0, samples=3)
    for result in (adamw, gd_gl):
        assert max(result["logit_change"]) < 1e-12  # still an exact symmetry of the forward pass
        for sector in gauge.SECTORS:
            assert result["summary"][f"relative_difference_{sector}"] > 0.05, (result["optimizer"], sector)
            assert result["summary"][f"random_gauge_variance_{sector}"] > 1e-4
    # A GL(d) gauge unbalances the Grams; a rotation leaves their norms alone.
    assert gd_gl["summary"]["gram_imbalance_gauged_QK"] > gd_gl["summary"]["gram_imbalance_QK"]
    assert gd_gl["summary"]["column_rms_ratio_gauged_VO"] > gd_gl["summary"]["column_rms_ratio_VO"]
    assert len(adamw["per_head"]["relative_difference_QK"]) == 2 and len(adamw["per_head"]["gram_imbalance_VO"][0]) == 2


def test_sampled_query_bias_breaks_the_gauge_and_is_reported():
    x, y = batch()
    model = tiny_model(bias_mode="bqbv", mean_q=0.5, mean_v=0.0)
    assert sensitivity.exact_sectors(model.config) == {"QK": False, "VO": True}
    result = sensitivity.gauge_diagnostic(model, "sgdm", PLAIN_GD, x, y, kind="gl", samples=1)
    assert result["logit_change"][0] > 1e-6 and result["exact"]["QK"] is False
    # Shared learned biases are factor rows: one gauge per layer keeps the forward pass exact.
    learned = sensitivity.gauge_diagnostic(tiny_model(bias_mode="learned"), "sgdm", PLAIN_GD, x, y, kind="gl", samples=1)
    assert learned["logit_change"][0] < 1e-12


def test_a_broken_gauge_transform_is_caught(monkeypatch):
    def only_queries(tensors, n_head, s_qk=None, s_vo=None):  # forgets the inverse on the keys
        out = dict(tensors)
        for name, value in tensors.items():
            if name.endswith("c_attn.weight"):
                out[name] = value.clone()
                out[name][: value.shape[1]] *= 2.0
        return out

    monkeypatch.setattr(sensitivity, "gauge_transformed", only_queries)
    x, y = batch()
    with pytest.raises(AssertionError, match="logits changed"):
        sensitivity.gauge_diagnostic(tiny_model(), "sgdm", PLAIN_GD, x, y, samples=1)


def test_the_global_rng_is_left_alone():
    x, y = batch()
    model = tiny_model()
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    sensitivity.diagnostic_summary(model, "adamw", ADAMW, x, y, step=3)
    torch.testing.assert_close(torch.rand(3), expected)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 4-step AdamW run of a tiny model logging the diagnostic every 2 steps, with its final checkpoint."""
    return train_tiny_run(tmp_path_factory.mktemp("gauge"), "--log-every", "1", "--gauge-diagnostic-every", "2",
                          "--bias-mode", "none")


def test_training_logs_the_diagnostic_every_n_steps(tiny_run):
    records = [r for r in read_log(tiny_run) if "train_loss" in r]
    assert [r["step"] for r in records if "gauge_dM_QK" in r] == [2, 4]
    for r in records:
        if "gauge_dM_QK" in r:
            assert r["gauge_dM_QK"] > 0.01 and r["gauge_dM_VO"] > 0.01 and r["gauge_logit_change"] < 1e-10
    assert "gauge ΔM" in (tiny_run / "log.txt").read_text()


def test_cli(tiny_run, tmp_path):
    result = gauge.main(["--run", str(tiny_run), "--out", str(tmp_path), "--samples", "2", "--batch-size", "2"])
    assert result["optimizer"] == "adamw" and result["lr"] == pytest.approx(1e-2) and result["step"] == 4
    saved = json.loads((tmp_path / "gauge.json").read_text())
    assert saved["summary"]["relative_difference_QK"] == pytest.approx(result["summary"]["relative_difference_QK"])
    assert (tmp_path / "gauge.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "gauge.md").read_text().startswith("# Gauge sensitivity")
    gd = gauge.main(["--run", str(tiny_run), "--out", str(tmp_path), "--samples", "2", "--batch-size", "2",
                     "--optimizer", "sgdm", "--gauge", "orthogonal"])
    assert gd["optimizer"] == "sgdm" and gd["lr"] == pytest.approx(0.03)  # another optimizer takes its defaults
    # Fresh SGD with (Nesterov) momentum takes a plain gradient step first: still rotation-equivariant.
    assert gd["summary"]["relative_difference_QK"] < 1e-9


def test_a_step_without_motion_gives_undefined_metrics_and_soap_is_refused_in_training(capsys):
    from optim import OPTIMIZERS

    x, y = batch()
    result = sensitivity.gauge_diagnostic(tiny_model(), "soap", OPTIMIZERS["soap"].config(), x, y, samples=1)
    assert np.isnan(result["summary"]["relative_difference_QK"])  # SOAP's first step builds its preconditioner
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--optimizer", "soap", "--gauge-diagnostic-every", "5"])
    assert "SOAP's first step" in capsys.readouterr().err
