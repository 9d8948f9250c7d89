"""The tensor-parallel dim of a user's mesh, and the expert-parallel mesh drawn from its
data-parallel ranks, shared by the transformers plans."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` if it is 1-D, else its dim named "tp"."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return mesh
    if "tp" not in (mesh.mesh_dim_names or ()):
        raise ValueError(f"a {mesh.ndim}-D mesh needs a dim named 'tp', got names "
                         f"{mesh.mesh_dim_names}")
    return mesh["tp"]


def ep_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The 2-D mesh ``("ep_replicate", "ep")`` of expert parallelism over ``ep`` ranks drawn
    from the data-parallel ranks of ``mesh`` (torchtitan's ``dp_shard_in_ep``): ``mesh``
    covers every rank of the world in rank order with its "tp" dim (T ranks) innermost, and
    each expert group is ``ep`` consecutive ranks: ``ep / T`` whole TP groups (their ranks
    hold different tokens: other batches, other sequence shards). ``ep_replicate``: the
    groups holding the same experts. Every rank must call it (it creates process groups)."""
    T, world = tp_mesh(mesh).size(), dist.get_world_size()
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive int, got {ep!r}")
    if ep % T or world % ep:
        raise ValueError(f"ep ({ep}) must be a multiple of the TP size ({T}) that divides the "
                         f"world size ({world}): each expert group is whole TP groups")
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(world)) or (mesh.ndim > 1 and (mesh.mesh_dim_names or ())[-1] != "tp"):
        raise ValueError(f"expert parallelism beyond the TP group needs a mesh over every rank "
                         f"in rank order with its 'tp' dim last, got {mesh!r}")
    return DeviceMesh(mesh.device_type, torch.arange(world).reshape(world // ep, ep),
                      mesh_dim_names=("ep_replicate", "ep"))
