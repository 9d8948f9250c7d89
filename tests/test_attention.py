"""Query-split attention's runs of consecutive query rows (`_runs`). The per-run attention
blocks are checked against SDPA in tests/test_query_split.py, with the multi-rank exactness
of the op."""

import torch

from commfuse.ops import attention


def test_runs():
    runs = attention._runs
    assert runs(torch.tensor([0, 1, 2, 6, 7, 3])) == [(0, 0, 3), (3, 6, 2), (5, 3, 1)]
    assert runs(torch.tensor([[4, 5], [9, 10]])) == [(0, 4, 2), (2, 9, 2)]  # flattened
    assert runs(torch.tensor([7])) == [(0, 7, 1)]
    assert runs(torch.tensor([], dtype=torch.long)) == []
