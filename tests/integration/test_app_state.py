"""snapcore.distributed.AppState and RankLocal in one process (no process group): the
model and optimizer through get_state_dict / set_state_dict, FQN-keyed, and overlap mode
finding the optimizer inside AppState. The multi-rank behaviour is in
tests/multiproc/test_sharded.py."""

from __future__ import annotations

from pathlib import Path

import pytest
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


def _assert_same(got: object, want: object, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), path
        for k in want:
            _assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{path}.{i}")
    else:
        assert got == want, path


def _fresh(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, object]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = get_state_dict(model, [optim])
    return {"model": m, "optim": o}


def test_app_state_reuses_its_state_dict_only_while_the_structure_holds() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optim = torch.optim.AdamW(model[0].parameters(), lr=0.01)  # layer 2: added later
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    app = AppState(model, optim)

    def train() -> None:
        model(torch.randn(4, 6)).square().mean().backward()
        optim.step()
        optim.zero_grad()

    train()
    first = app.state_dict()
    _assert_same(first, _fresh(model, optim))
    assert app._cache is not None  # the default options: the structure is kept

    def check(change: str) -> None:
        got = app.state_dict()
        _assert_same(got, _fresh(model, optim), change)

    train()  # in place: the cached entry is reused, and sees the new values
    cached = app._cache
    check("a step")
    assert app._cache is cached
    assert torch.equal(app.state_dict()["model"]["0.weight"], model[0].weight)

    sched.step()  # a hyperparameter: read fresh
    optim.param_groups[0]["weight_decay"] = 0.5
    check("lr")
    assert app.state_dict()["optim"]["param_groups"][0]["lr"] == optim.param_groups[0]["lr"]
    assert app.state_dict()["optim"]["param_groups"][0]["weight_decay"] == 0.5

    optim.add_param_group({"params": list(model[2].parameters()), "lr": 0.1})
    check("a new group")
    train()  # new per-parameter state
    check("new state")
    assert "2.weight" in app.state_dict()["optim"]["state"]

    model[0].bias.requires_grad_(False)  # frozen
    train()
    check("frozen")

    old = model[2].weight  # a new parameter object (in the optimizer too)
    with torch.no_grad():
        model[2].weight = torch.nn.Parameter(old * 2)
    group = optim.param_groups[1]
    group["params"] = [model[2].weight if p is old else p for p in group["params"]]
    optim.state[model[2].weight] = optim.state.pop(old)
    check("new parameter")
    model[0].weight.data = model[0].weight.data * 3  # new storage under an old parameter
    check("new storage")
    assert torch.equal(app.state_dict()["model"]["0.weight"], model[0].weight)

    del optim.state[model[0].weight]["exp_avg"]  # a state key gone
    check("state key")
    optim.state[model[0].weight]["exp_avg"] = torch.ones(5, 6)  # a new tensor object
    check("state tensor")
    assert torch.equal(app.state_dict()["optim"]["state"]["0.weight"]["exp_avg"], torch.ones(5, 6))


def test_app_state_snapshots_see_a_changed_learning_rate(tmp_path: Path) -> None:
    model, optim = _trained(0)
    app = AppState(model, optim)
    snapcore.save({"app": app}, tmp_path, step=1)
    for g in optim.param_groups:
        g["lr"] = 0.125
    model(torch.randn(4, 6)).square().mean().backward()
    optim.step()
    saved = _everything(model, optim)
    snapcore.save({"app": app}, tmp_path, step=2)
    tree = snapcore.load(tmp_path, step=2)
    assert tree["app"]["optim"]["param_groups"][0]["lr"] == 0.125
    other, other_optim = _trained(1)
    snapcore.restore({"app": AppState(other, other_optim)}, tmp_path, step=2)
    got = _everything(other, other_optim)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    assert other_optim.param_groups[0]["lr"] == 0.125


def test_rank_local_is_restored_in_place_and_strictly(tmp_path: Path) -> None:
    """RankLocal's value is restored as the same value in the state would be: a dict keeps
    its identity and gets every saved key (numbers, lists and tensors alike), and a key the
    snapshot lacks is refused with strict=True, listed with strict=False."""
    pos = {"epoch": 3, "i": 7, "seen": [1, 2], "t": torch.tensor([7.0, 7.0]), "name": "a"}
    snapcore.save({"loader": RankLocal(pos), "n": RankLocal(5)}, tmp_path, step=1)

    live = {"epoch": 0, "i": 0, "seen": [0], "t": torch.zeros(2), "name": "b"}
    t = live["t"]
    holder, n = RankLocal(live), RankLocal(0)
    info = snapcore.restore({"loader": holder, "n": n}, tmp_path)
    assert info.step == 1 and info.missing == []
    assert holder.value is live and live["t"] is t  # the caller's objects, filled
    assert live["epoch"] == 3 and live["i"] == 7 and live["seen"] == [1, 2] and live["name"] == "a"
    assert torch.equal(t, torch.tensor([7.0, 7.0])) and n.value == 5

    extra = RankLocal({"epoch": 0, "i": 0, "seen": [], "t": torch.zeros(2), "name": "", "new": 1})
    with pytest.raises(snapcore.StateMismatch, match=r"loader\.value\.new"):
        snapcore.restore({"loader": extra, "n": RankLocal(0)}, tmp_path)
    assert extra.value["epoch"] == 0  # refused before anything changed
    info = snapcore.restore({"loader": extra, "n": RankLocal(0)}, tmp_path, strict=False)
    assert info.missing == ["loader.value.new"] and extra.value["epoch"] == 3
