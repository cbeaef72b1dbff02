"""snapcore.distributed.AppState and RankLocal in one process (no process group): the
model and optimizer through get_state_dict / set_state_dict, FQN-keyed, and overlap mode
finding the optimizer inside AppState. The multi-rank behaviour is in
tests/multiproc/test_sharded.py."""

from __future__ import annotations

from pathlib import Path

import torch

import snapcore
from snapcore.distributed import AppState, RankLocal
from snapcore.tree import flatten


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 6)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _everything(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in optim.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.clone() for k, v in st.items()})
    return out


def test_app_state_round_trips_a_model_and_optimizer_keyed_by_name(tmp_path: Path) -> None:
    model, optim = _trained(0)
    saved = _everything(model, optim)
    snapcore.save({"app": AppState(model, optim), "pos": RankLocal({"i": 7})}, tmp_path, step=1)
    tree = snapcore.load(tmp_path)
    assert set(tree["app"]["optim"]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert tree["pos"] == {"value": {"i": 7}}

    other, other_optim = _trained(1)
    pos = RankLocal({"i": 0})
    info = snapcore.restore({"app": AppState(other, other_optim), "pos": pos}, tmp_path)
    assert info.step == 1 and pos.value == {"i": 7}
    got = _everything(other, other_optim)
    assert got.keys() == saved.keys()
    assert all(torch.equal(got[k], saved[k]) for k in saved)


def test_app_state_names_its_optimizers_for_overlap_mode(tmp_path: Path) -> None:
    model, optim = _trained(0)
    app = AppState(model, optim)
    assert flatten({"app": app}).optimizers == [optim]
    saved = _everything(model, optim)
    h = snapcore.async_save({"app": app}, tmp_path, step=2, overlap=True)
    # the optimizer's next step waits for the deferred copies: the snapshot is step 2's
    model(torch.randn(4, 6)).square().mean().backward()
    optim.step()
    h.wait()
    other, other_optim = _trained(1)
    snapcore.restore({"app": AppState(other, other_optim)}, tmp_path)
    got = _everything(other, other_optim)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    snapcore.close()
