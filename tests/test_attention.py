"""Query-split attention's runs of consecutive query rows (`_runs`). The per-run attention
blocks are checked against SDPA in tests/test_query_split.py, with the multi-rank exactness
of the op."""

from commfuse.ops import attention


def test_runs():
    assert attention._runs([0, 1, 2, 6, 7, 3]) == [(0, 0, 3), (3, 6, 2), (5, 3, 1)]
