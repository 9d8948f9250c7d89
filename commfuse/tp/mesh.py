"""The tensor-parallel dim of a user's mesh, shared by the transformers plans."""

from __future__ import annotations

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
