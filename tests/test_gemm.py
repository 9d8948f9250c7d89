"""`commfuse.runtime.modes.gemm`, the GEMM of every fused op: one matrix multiply over the
leading dims folded into rows, whatever the strides of the operand (torch.matmul runs a batched
GEMM, one per leading index, for operands that do not fold into a view when the weight does not
require grad, as an inference model's buffers do: several times slower for a prefill's
slots)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from commfuse.runtime import modes


class AtenLog(TorchDispatchMode):
    """The aten ops dispatched on this thread while active."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func).split(".")[1])
        return func(*args, **(kwargs or {}))


def moved(B: int, S: int, K: int) -> torch.Tensor:
    """[S, B, K] as the ops see a [B, S, K] activation whose dim 1 is gathered / scattered."""
    return torch.randn(B, S, K, dtype=torch.float64).movedim(1, 0)


# operands that do not fold into a view of rows: the moved dim (B = 1 keeps a stride of its
# size-1 dim that matmul does not skip), a slot of it, a strided chunk [W, n, M, K] of it
OPERANDS = {"moved-B1": lambda: moved(1, 12, 5), "moved-B3": lambda: moved(3, 12, 5),
            "slot-B1": lambda: moved(1, 12, 5)[4:8], "slot-B3": lambda: moved(3, 12, 5)[4:8],
            "chunk": lambda: moved(3, 12, 5).unflatten(0, (2, 6))[:, 1:4]}


@pytest.mark.parametrize("name", OPERANDS)
@pytest.mark.parametrize("with_out", [False, True])
def test_one_gemm_whatever_the_strides(name, with_out):
    a = OPERANDS[name]()
    b = torch.randn(5, 7, dtype=torch.float64)  # no grad: matmul would not fold
    with AtenLog() as plain:
        want = torch.matmul(a, b)
    out = torch.empty(*a.shape[:-1], 7, dtype=torch.float64) if with_out else None
    with AtenLog() as log:
        got = modes.gemm(a, b, out=out)
    assert "bmm" in plain.ops  # the case this guards against
    assert log.ops.count("mm") == 1 and "bmm" not in log.ops, log.ops
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if with_out:
        assert got is out


def test_out_that_does_not_fold_and_plain_cases():
    a, b = moved(3, 8, 5), torch.randn(5, 4, dtype=torch.float64)
    out = torch.empty(4, 3, 8, dtype=torch.float64).permute(2, 1, 0)  # [8, 3, 4], strided
    assert modes.gemm(a, b, out=out) is out
    torch.testing.assert_close(out, a @ b, rtol=1e-12, atol=1e-12)
    a2 = torch.randn(6, 5, dtype=torch.float64)  # 2-D and batched operands: torch.matmul's
    torch.testing.assert_close(modes.gemm(a2, b), a2 @ b, rtol=0, atol=0)
    a3, b3 = torch.randn(2, 6, 5, dtype=torch.float64), torch.randn(2, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(modes.gemm(a3, b3), a3 @ b3, rtol=0, atol=0)


def test_gradients_and_comm_only():
    a = moved(1, 6, 5).requires_grad_()
    b = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(modes.gemm, (a, b))
    with modes.mode("comm_only"):
        y = modes.gemm(a.detach(), b.detach())
    assert y.shape == (6, 1, 4)


@pytest.mark.parametrize("shape_a,shape_b", [((0, 3, 5), (5, 4)), ((2, 3, 0), (0, 4)),
                                             ((2, 3, 5), (5, 0)), ((2, 0, 0), (0, 0))])
def test_empty_operands(shape_a, shape_b):
    """Empty rows, an empty K (the product is zeros) or an empty N: as torch.matmul."""
    a, b = torch.randn(*shape_a, dtype=torch.float64), torch.randn(*shape_b, dtype=torch.float64)
    torch.testing.assert_close(modes.gemm(a.transpose(0, 1), b), a.transpose(0, 1) @ b,
                               rtol=0, atol=0)
    out = torch.full((*a.transpose(0, 1).shape[:-1], b.shape[1]), 7.0, dtype=torch.float64)
    assert modes.gemm(a.transpose(0, 1), b, out=out) is out
    torch.testing.assert_close(out, a.transpose(0, 1) @ b, rtol=0, atol=0)
