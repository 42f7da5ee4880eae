"""bench.soap_parity: the trajectories' distance is reported, and its turned null space is another exact
eigendecomposition (a stand-in for the published class: the repository carries no peer code)."""
from __future__ import annotations

import textwrap

import torch

from bench import soap_parity
from tests.helpers import PUBLISHED_SOAP


class Eigh(torch.optim.SGD):
    """The published SOAP's first-basis method: eigh's eigenvectors of each factor, descending."""

    def get_orthogonal_matrix(self, factors):
        return [torch.flip(torch.linalg.eigh(f)[1], [1]) if len(f) else [] for f in factors]


def test_turned_null_space_is_another_eigendecomposition():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    factor = g @ g.T  # rank 3: a 5-dimensional null space
    original = Eigh([torch.zeros(1)], lr=0.1).get_orthogonal_matrix([factor, []])[0]
    turned = soap_parity.turned_null_space(Eigh)([torch.zeros(1)], lr=0.1).get_orthogonal_matrix([factor, []])
    q = turned[0]
    assert turned[1] == []
    torch.testing.assert_close(q.T @ q, torch.eye(8, dtype=torch.float64))
    rotated = q.T @ factor @ q
    torch.testing.assert_close(rotated, torch.diag(torch.diagonal(rotated)), atol=1e-10, rtol=0)  # still diagonal
    torch.testing.assert_close(q[:, :3].abs(), original[:, :3].abs())  # the range is kept
    assert (q[:, 3:] - original[:, 3:]).abs().max() > 0.1  # the null space's basis is not


def test_reports_the_distance_between_the_trajectories(tmp_path, capsys):
    (tmp_path / "soap.py").write_text(textwrap.dedent(PUBLISHED_SOAP))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        soap_parity.main(["--published-soap", str(tmp_path / "soap.py"), "--n-layer", "1", "--n-head", "2",
                          "--n-embd", "32", "--batch", "1", "--seq-len", "16", "--steps", "3"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "the published run moved" in out and "ours vs published: max |difference|" in out, out
