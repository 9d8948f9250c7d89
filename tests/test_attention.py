"""Query-split attention's per-slot attention (`_rows_attention`): any set of query rows,
causal or not, equals those rows of the whole sequence's attention; positions are host
integers and no boolean mask is built (SDPA gets ``is_causal`` or a lower-right causal bias,
which its fused kernels take). The multi-rank exactness of the op is in tests/test_bench.py."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

from commfuse.ops import attention


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("pos", [[0, 1, 2], [3, 4, 5, 6], [5], [0, 1, 6, 7], [2, 3, 8, 9, 10, 11],
                                 list(range(12))])
def test_rows_attention_matches_the_whole_sequence(monkeypatch, causal, pos):
    g = torch.Generator().manual_seed(len(pos))
    q, k, v = (torch.randn(2, 3, 12, 4, generator=g, dtype=torch.float64) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)[:, :, pos]
    masks, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kw):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(attention, "F", SimpleNamespace(scaled_dot_product_attention=spy))
    out = attention._rows_attention(q[:, :, pos], k, v, pos, causal)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert all(m is None or isinstance(m, CausalBias) for m in masks)
    assert len(masks) == len(attention._runs(pos))


def test_runs():
    assert attention._runs([0, 1, 2, 6, 7, 3]) == [(0, 0, 3), (3, 6, 2), (5, 3, 1)]
