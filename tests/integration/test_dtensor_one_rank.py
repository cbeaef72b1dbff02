"""DTensors under a process group of one rank (`torchrun --nproc-per-node 1` with FSDP2,
say): not a sharded save (that needs two ranks or more), but each DTensor holds its
whole tensor, which is saved and restored as it is. A DTensor that does not hold its
whole tensor is refused, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import snapcore
from snapcore.errors import UnsupportedState


def test_a_one_rank_dtensor_saves_and_restores_whole(tmp_path: Path, gloo_group: None) -> None:
    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(8, 4, generator=g), torch.randn(4, generator=g).to(torch.bfloat16)
    state = {
        "w": distribute_tensor(w, mesh, [Shard(0)]),
        "b": distribute_tensor(b, mesh, [Replicate()]),
        "plain": torch.arange(5),
        "step": 3,
    }
    snapcore.save(state, tmp_path / "s", step=1)
    # with no process group needed: plain tensors
    back = snapcore.load(tmp_path / "s")
    assert torch.equal(back["w"], w) and torch.equal(back["b"], b) and back["step"] == 3
    # restored into DTensors of the same kind, in place
    target = {
        "w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.zeros(4, dtype=torch.bfloat16), mesh, [Replicate()]),
        "plain": torch.zeros(5, dtype=torch.int64),
        "step": 0,
    }
    before = target["w"]
    snapcore.restore(target, tmp_path / "s")
    assert target["w"] is before and isinstance(target["w"], DTensor)
    assert torch.equal(target["w"].full_tensor(), w)
    assert torch.equal(target["b"].full_tensor(), b)
    assert torch.equal(target["plain"], torch.arange(5)) and target["step"] == 3


def test_a_dtensor_without_its_whole_tensor_is_refused(tmp_path: Path, gloo_group: None) -> None:
    mesh = init_device_mesh("cpu", (1,))
    padded = DTensor.from_local(torch.ones(3, 3), mesh, [Shard(0)], shape=(5, 3), stride=(3, 1))
    with pytest.raises(UnsupportedState, match=r"layer\.w: a DTensor of shape \(5, 3\)") as e:
        snapcore.save({"layer": {"w": padded}}, tmp_path / "s", step=1)
    assert e.value.path == "layer.w"
