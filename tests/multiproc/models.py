"""Small sharded models for multi-process tests, on CPU with gloo (imported by rank scripts).

`build(kind)` returns (model, optimizer) for one of KINDS, every rank starting from the
same seeded init (so the global tensors agree) and taking `steps` AdamW steps so that
optimizer state exists. The model (`ToyModel`, a few KB) has sharded dims that divide
neither 2 nor 4 ranks: fc2's 13 rows; `scale`'s 3 entries, which leave rank 3 of 4 an
empty FSDP2 shard. Shard sizes follow torch.chunk (13 over 4 ranks: 4, 4, 4, 1).

  fsdp2  fully_shard per layer and at the root, on init_device_mesh("cpu", (world,)):
         every parameter Shard(0); the buffer `buf` stays a plain tensor.
  tp     parallelize_module: fc1 ColwiseParallel (Shard(0)), fc2 RowwiseParallel
         (weight Shard(1), bias Replicate), head ColwiseParallel with a replicated output
         (Shard(0), 7 rows: uneven on 4 ranks); `scale` and `buf` stay plain tensors,
         replicated by convention. Every rank trains on the same batch, as TP needs.
  hsdp   fully_shard on a 2-D mesh ("replicate", "shard") = (2, world // 2): placements
         (Replicate(), Shard(0)).
  ddp    DistributedDataParallel: plain tensors, equal on every rank.
  pp     two pipeline stages on a 2-D mesh ("pp", "dp") = (2, world // 2): each stage
         holds its own model (`stage0.*` or `stage1.*`, other weights) under FSDP2 on its
         stage's ranks (mesh["dp"]), so the two stages' states differ. The stages do not
         pass activations: the point is the state each rank holds.

Data-parallel kinds (fsdp2, hsdp, ddp) train each rank on its own batch.

Quirks of torch 2.13 (CPU, gloo) found while writing this:
- fully_shard, 2-D HSDP meshes, TP and DDP all work on a "cpu" device mesh with gloo.
- TP: ColwiseParallel on a Linear with fewer output features than ranks (an empty
  shard) gives a Replicate gradient for a Shard(0) parameter, and AdamW's step then
  fails ("aten.lerp_.Scalar: in-place operations that require placement changes are not
  supported"). So every TP-sharded dim here is at least 4; only FSDP2 gets an empty
  shard (`scale` on 4 ranks), which it handles.
- A rank that exits without destroy_process_group() sometimes aborts at interpreter
  exit (SIGABRT, "terminate called without an active exception"; 2 of 6 tries of a
  bare init + all_reduce on 2 ranks), so rank scripts end with `shutdown()`. It still
  happened once after `shutdown()` (rank_models.py in CI, 2026-11-23), so the script that
  runs torch alone also leaves with `os._exit(0)` once its report is written.
- get_state_dict gives FQN keys without DDP's "module." prefix; AdamW's `step` is a
  plain tensor even where exp_avg/exp_avg_sq are DTensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

KINDS = ("fsdp2", "tp", "hsdp", "ddp")
D_IN = 16
BATCH = 4


class ToyModel(nn.Module):
    """16 -> 24 -> 13 -> 7, plus a 3-entry parameter and a 5-entry buffer (~3.5 KB)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, 24)
        self.fc2 = nn.Linear(24, 13)
        self.head = nn.Linear(13, 7)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.register_buffer("buf", torch.arange(5, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.head(h) * self.scale.sum()


def init_gloo() -> None:
    """Join the job torchrun started (gloo, from its environment); a no-op if joined."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def shutdown() -> None:
    """Leave the job: call before a rank script returns (see the quirks above)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def make_model(seed: int = 0) -> ToyModel:
    """The unsharded model, identical for a given seed on every rank and in every run."""
    torch.manual_seed(seed)
    return ToyModel()


def build_fsdp2(*, steps: int = 2, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    init_gloo()
    model = _fully_shard(make_model(seed), init_device_mesh("cpu", (dist.get_world_size(),)))
    return _trained(model, steps, seed, same_batch=False)


def build_hsdp(
    *, steps: int = 2, seed: int = 0, replicas: int = 2
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """HSDP: `replicas` replica groups, each sharding over world // replicas ranks."""
    init_gloo()
    world = dist.get_world_size()
    if world % replicas:
        raise ValueError(f"hsdp: {world} ranks do not split into {replicas} replicas")
    mesh = init_device_mesh(
        "cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
    )
    return _trained(_fully_shard(make_model(seed), mesh), steps, seed, same_batch=False)


def build_tp(*, steps: int = 2, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    init_gloo()
    if dist.get_world_size() > 7:
        raise ValueError("tp: head has 7 rows; more ranks would leave one empty (see quirks)")
    model = parallelize_module(
        make_model(seed),
        init_device_mesh("cpu", (dist.get_world_size(),)),
        {
            "fc1": ColwiseParallel(),
            "fc2": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    return _trained(model, steps, seed, same_batch=True)


def build_ddp(*, steps: int = 2, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    init_gloo()
    model = nn.parallel.DistributedDataParallel(make_model(seed))
    return _trained(model, steps, seed, same_batch=False)


def build_fsdp_tp(*, steps: int = 2, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 + TP on a 2-D mesh ("dp", "tp") = (world // 2, 2): tensor parallel inside
    each pair of ranks, then fully_shard over the data-parallel dimension (the layout of
    torchtitan's 2-D parallelism). The ranks of a TP pair train on the same batch."""
    init_gloo()
    world = dist.get_world_size()
    if world % 2:
        raise ValueError("fsdp_tp: needs an even number of ranks")
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(
        make_model(seed),
        mesh["tp"],
        {
            "fc1": ColwiseParallel(),
            "fc2": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    model = _fully_shard(model, mesh["dp"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = mesh["dp"].get_local_rank()
    data = torch.Generator().manual_seed(1000 + seed + dp)
    for _ in range(steps):
        model(torch.randn(BATCH, D_IN, generator=data)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


class StageModel(nn.Module):
    """Pipeline stage `stage`'s part of a model: a ToyModel under the name `stage{stage}`."""

    def __init__(self, stage: int, seed: int) -> None:
        super().__init__()
        self.name = f"stage{stage}"
        self.add_module(self.name, make_model(seed + 17 * stage))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.name)(x)


def build_pp(*, steps: int = 2, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    init_gloo()
    world = dist.get_world_size()
    if world % 2:
        raise ValueError("pp: needs an even number of ranks")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    model = StageModel(mesh["pp"].get_local_rank(), seed)
    _fully_shard(getattr(model, model.name), mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return _trained(model, steps, seed, same_batch=False)


BUILDERS = {
    "fsdp2": build_fsdp2,
    "tp": build_tp,
    "hsdp": build_hsdp,
    "ddp": build_ddp,
    "fsdp_tp": build_fsdp_tp,
    "pp": build_pp,
}


def build(kind: str, *, steps: int = 2, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(model, AdamW) of one of KINDS after `steps` steps; joins the gloo job if needed."""
    return BUILDERS[kind](steps=steps, seed=seed)


def _fully_shard(model: ToyModel, mesh: DeviceMesh) -> ToyModel:
    for layer in (model.fc1, model.fc2, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root holds `scale`
    return model


def _trained(
    model: nn.Module, steps: int, seed: int, *, same_batch: bool
) -> tuple[nn.Module, torch.optim.Optimizer]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1000 + seed + (0 if same_batch else dist.get_rank()))
    for _ in range(steps):
        model(torch.randn(BATCH, D_IN, generator=data)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def get_model_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """{"model": ..., "optim": ...} from DCP's get_state_dict: FQN keys, DTensor shards."""
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a tree of dicts/lists/tuples, with its dotted path, in tree order."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, Mapping):
        for k, v in state.items():
            yield from tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            yield from tensors(v, f"{prefix}.{i}" if prefix else str(i))


def global_tensors(state: Any) -> dict[str, torch.Tensor]:
    """The full global value of every tensor (a DTensor's full_tensor(), a plain tensor as
    it is), as a detached CPU copy, by dotted path. A collective when the state holds
    DTensors: every rank must call it with the same structure."""
    out = {}
    for path, t in tensors(state):
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[path] = full.detach().cpu().clone()
    return out


def describe(state: Any) -> dict[str, dict[str, Any]]:
    """Per tensor (JSON-ready): global and local shape, dtype, placements and mesh shape
    (None for a plain tensor)."""
    out = {}
    for path, t in tensors(state):
        is_d = isinstance(t, DTensor)
        out[path] = {
            "shape": list(t.shape),
            "local_shape": list(t.to_local().shape if is_d else t.shape),
            "dtype": str(t.dtype),
            "placements": [repr(p) for p in t.placements] if is_d else None,
            "mesh_shape": list(t.device_mesh.shape) if is_d else None,
        }
    return out


def digest(t: torch.Tensor) -> str:
    """sha256 of dtype, shape and bytes: equal digests mean bit-identical tensors."""
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(flat.numpy().tobytes())
    return h.hexdigest()
