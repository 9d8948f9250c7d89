"""The vocabulary-parallel loss of ``commfuse.tp.parallelize(..., loss_parallel=True)``.

The output head then keeps this rank's vocabulary columns of the whole sequence's logits
(``[B, S, V/T]``, no all-gather after it), and the model's ``loss_function`` becomes
Megatron's cross-entropy over those columns (`commfuse.parallel.vocab`: a max and a
[sum-exp, target logit] all-reduce of ``[B, S]`` floats), so the ``[B, S, V]`` logits never
exist on any rank. The loss equals the unsharded model's up to float rounding (the softmax's
sum is taken in two parts); its gradient reaches the head's columns locally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.parallel.vocab import vocab_parallel_cross_entropy
from commfuse.tp.functional import chunk_sizes
from commfuse.tp.style import FusedColwiseParallel


def head_style(model: nn.Module, loss_parallel: bool, ag: dict) -> FusedColwiseParallel:
    """The output head's style: full logits on every rank, or (``loss_parallel``, checked on
    ``model`` by `check_loss_parallel`) this rank's vocabulary columns."""
    if loss_parallel:
        check_loss_parallel(model)
    return FusedColwiseParallel(gather_output=not loss_parallel, **ag)


def check_loss_parallel(model: nn.Module) -> None:
    """Raise when the model's loss reads more than the cross-entropy of its logits."""
    z = getattr(getattr(model, "config", None), "z_loss_coefficient", 0) or 0
    if z:
        raise ValueError(f"loss_parallel=True: {type(model).__name__} adds a z-loss "
                         f"(z_loss_coefficient={z}) computed from the full logits; set it to 0 "
                         f"or use loss_parallel=False")
    if not hasattr(model, "loss_function"):
        raise ValueError(f"loss_parallel=True needs a transformers model with a loss_function; "
                         f"{type(model).__name__} has none")


def vocab_start(head: nn.Module, group) -> int:
    """The first vocabulary id of this rank's columns of ``head`` (sharded by the plan)."""
    return sum(chunk_sizes(head.weight.shape[0], group.size())[:group.rank()])


def install_loss_parallel(model: nn.Module, group) -> None:
    """Make ``model.loss_function`` the vocabulary-parallel causal-LM loss over ``group``,
    with the call signature of transformers' ``ForCausalLMLoss``; ``model.generate`` then
    gathers the head's columns while it runs (it samples from whole logits)."""
    start = vocab_start(model.lm_head, group)

    def loss_function(logits: torch.Tensor, labels: torch.Tensor | None = None,
                      vocab_size: int | None = None,
                      num_items_in_batch: torch.Tensor | int | None = None,
                      ignore_index: int = -100, shift_labels: torch.Tensor | None = None,
                      **kwargs) -> torch.Tensor:
        if shift_labels is None:  # tokens < n predict n, as ForCausalLMLoss shifts
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        per_token = vocab_parallel_cross_entropy(logits, shift_labels, start, group,
                                                 ignore_index)
        if num_items_in_batch is None:  # "mean" over the tokens not ignored
            return per_token.sum() / (shift_labels != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(per_token.device)
        return per_token.sum() / num_items_in_batch

    model.loss_function = loss_function
    head, generate = model.lm_head._commfuse_colwise, model.generate

    def generate_whole(*args, **kwargs):  # sampling reads every column of the logits
        head.gather_output = True
        try:
            return generate(*args, **kwargs)
        finally:
            head.gather_output = False

    model.generate = generate_whole
