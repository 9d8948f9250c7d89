"""``commfuse train``: train a Llama preset on the shipped corpus with TP / UP / DP applied by a
plan, or a transformers model built from a config (``--hf-config``: commfuse.tp over --tp,
FSDP2 over --dp, the experts of an MoE config over the --tp or --ep ranks; `commfuse.train.hf`).

Local mode spawns ``--nproc`` ranks (gloo, `commfuse.testbed.spawn.run_local`); under ``torchrun`` (or
``commfuse launch``) the RANK / WORLD_SIZE / LOCAL_RANK environment is detected and the process
group is initialised from it instead. One rank (``--nproc 1``) runs in this process, unsharded.

Per step: the global mean loss, tokens/s, MFU = flops_per_token * tokens/s / peak, where
flops_per_token is `commfuse.models.llama.flops_per_token` (6N + 12*L*H*Q*T, PaLM appendix B,
as nanoGPT) and peak is ``--peak-flops`` per rank, or a dense matmul measured on each rank at
startup (CPUs publish no usable peak). Exposed communication is measured once, after training:
the median fwd+bwd+grad sync time minus the median of the same fwd+bwd with the executor in
``compute_only`` mode (same partitioned GEMMs, no transfers), interleaved. It is not measured
per step (that would double the work). What the gradient buckets posted during the backward
did not hide (`sync_grads` waits for them) counts as exposed, and so do the vocabulary-parallel
embedding's and loss's collectives (skipped in compute_only mode); the other plain collectives
(the loss's token count, the DP weight all-gather under TP/UP x DP) still run in compute_only
mode, so they count as compute: the figure is a lower bound.
--compare-none also trains the same model with method none on the same ranks and batches,
the two models' steps in turn (with --hf-config: a second run after the first): same losses up
to summation order, and the step-time ratio (the median of each step's ratio), ending with a
one-line verdict (`commfuse.train.compare`): the ratio, the share of none's exposed
communication the method hid, the loss check, or why the ratio cannot show overlap.
"""

from __future__ import annotations

from commfuse import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "commfuse.train.config": ("TrainConfig", "DTYPES", "add_arguments", "config_from_args"),
    "commfuse.train.command": ("run",),
    "commfuse.train.loop": ("launch", "train_rank", "lr_at", "seq_len_at"),
    "commfuse.train.__main__": ("main",),
})
