"""Checkpoints of a parallelized model: torch.distributed.checkpoint, a key space per rank,
atomic directories.

`save_checkpoint` / `load_checkpoint` write and read every rank's shards and optimizer state
(same layout to resume; no resharding yet).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from commfuse.parallel.plan import ParallelLlama


def _rank_world(pmodel: ParallelLlama) -> tuple[int, int]:
    return (pmodel.mesh.rank, pmodel.mesh.world) if pmodel.mesh is not None else (0, 1)


def _state(pmodel: ParallelLlama, optimizer, step: int = 0) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(pmodel, optimizer)  # creates AdamW's state if need be
    # shards of different ranks share names: a key per rank keeps DCP from deduplicating them
    return {f"rank{_rank_world(pmodel)[0]}": {"model": model_sd, "optim": optim_sd},
            "step": torch.tensor(step)}


@contextlib.contextmanager
def _dcp(world: int):
    """Barriers around a DCP call; for one process, silence its "assuming a single process"."""
    if world > 1:
        dist.barrier()
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield
    if world > 1:
        dist.barrier()


def save_checkpoint(pmodel: ParallelLlama, optimizer, root: str, step: int, meta: dict) -> str:
    """Model + optimizer state (every rank's shards) + step as ``root/step-N`` (collective).

    Written to ``root/.tmp-step-N`` and renamed when complete, then ``root/latest`` is replaced
    (atomically, `os.replace`) by a file naming it; ``meta`` (JSON) is stored beside the state
    for `load_checkpoint` to compare. Saving a step that already has a directory (``latest``
    may name it) writes a new version ``step-N-rK`` and deletes the old one only after
    ``latest`` names the new one, so at every moment ``latest`` names a complete checkpoint.
    Returns the checkpoint's path.
    """
    import torch.distributed.checkpoint as dcp

    rank, world = _rank_world(pmodel)
    name = f"step-{step:08d}"
    tmp, latest = os.path.join(root, f".tmp-{name}"), os.path.join(root, "latest")
    old = _versions(root, name)  # the same on every rank: nothing renames before the save
    final = os.path.join(root, f"{name}-r{max(old.values()) + 1}" if old else name)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    with _dcp(world):
        dcp.save(_state(pmodel, optimizer, step), checkpoint_id=tmp, no_dist=world == 1)
    if rank == 0:
        Path(tmp, "meta.json").write_text(json.dumps(meta))
        os.rename(tmp, final)
        Path(latest + ".tmp").write_text(os.path.basename(final))
        os.replace(latest + ".tmp", latest)
        for path in old:  # no longer named by latest
            shutil.rmtree(os.path.join(root, path), ignore_errors=True)
    if world > 1:
        dist.barrier()
    return final


def _versions(root: str, name: str) -> dict[str, int]:
    """The directories of checkpoint ``name`` in ``root``: ``name`` (version 0) and each
    ``name-rK`` (version K)."""
    if not os.path.isdir(root):
        return {}
    return {n: 0 if n == name else int(n[len(name) + 2:]) for n in os.listdir(root)
            if n == name or (n.startswith(name + "-r") and n[len(name) + 2:].isdigit())}


def load_checkpoint(pmodel: ParallelLlama, optimizer, root: str, meta: dict) -> int:
    """Load ``root/latest`` into the model and optimizer; return its step (0: no checkpoint).

    ValueError if it was saved with other ``meta`` (another layout: resharding is not
    supported, each rank reads back exactly the shards it wrote).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    pointer = os.path.join(root, "latest")
    if not os.path.exists(pointer):
        return 0
    path = os.path.join(root, Path(pointer).read_text().strip())
    saved = json.loads(Path(path, "meta.json").read_text())
    if saved != json.loads(json.dumps(meta)):
        raise ValueError(f"checkpoint {path} was written with {saved}; this run is {meta} "
                         "(resharding is not supported)")
    rank, world = _rank_world(pmodel)
    state = _state(pmodel, optimizer)
    with _dcp(world):
        dcp.load(state, checkpoint_id=path, no_dist=world == 1)
    mine = state[f"rank{rank}"]
    set_state_dict(pmodel, optimizer, model_state_dict=mine["model"],
                   optim_state_dict=mine["optim"])
    return int(state["step"])
