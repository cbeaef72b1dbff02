"""restore(): strict matching against the live state, partial restores, key normalisation,
and the fallback to an older step when the newest is damaged in every tier."""

from __future__ import annotations

import logging
import random
import uuid
from typing import Any

import pytest
import torch

import snapcore
from snapcore.directory import MANIFEST, step_dir_name
from snapcore.tiers import LocalTier, RemoteStoreTier
from snapcore.write.engine import close_all, engine_for


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    close_all()


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return len(sa) == len(sb) and all(
        bits(x) == bits(y) for x, y in zip(sa.values(), sb.values(), strict=True)
    )


# -- item 1: strict restore -------------------------------------------------------------


def test_a_saved_state_dict_fills_a_module_in_place(tmp_path):
    model, _ = trained()
    snapcore.save({"model": model.state_dict()}, tmp_path, step=1)  # a plain dict
    live = make_model()
    state = {"model": live}
    storages = [p.data_ptr() for p in live.parameters()]
    params = list(live.parameters())
    info = snapcore.restore(state, tmp_path)
    assert state["model"] is live  # not replaced by a dict
    assert same_params(live, model)  # the weights are the snapshot's
    assert [p.data_ptr() for p in live.parameters()] == storages  # filled in place
    assert all(p is q for p, q in zip(live.parameters(), params, strict=True))
    assert info.missing == [] and info.unexpected == []


def test_restore_bumps_the_version_of_every_tensor_it_fills(tmp_path):
    """A contiguous CPU tensor is filled by the native reader through its address (no
    torch op; on a GPU, the native copier: tests/gpu): restore bumps its version counter
    as copy_ does for the others, so that autograd refuses a backward through a graph
    that saved the old values instead of computing a wrong gradient."""
    saved = {"direct": torch.arange(6.0), "strided": torch.arange(6.0).reshape(2, 3)}
    snapcore.save(saved, tmp_path, step=1)
    live = {"direct": torch.zeros(6), "strided": torch.zeros(3, 2).t()}  # not contiguous
    x = torch.ones(6, requires_grad=True)
    y = (live["direct"] * x).sum()  # saves live["direct"] for x's gradient
    before = {k: t._version for k, t in live.items()}
    snapcore.restore(live, tmp_path)
    for k, t in live.items():
        assert torch.equal(t, saved[k]), k
        assert t._version > before[k], k
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_a_saved_module_fills_a_dict_of_its_tensors(tmp_path):
    model, _ = trained()
    snapcore.save({"model": model}, tmp_path, step=1)
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    ptrs = {k: v.data_ptr() for k, v in sd.items()}
    snapcore.restore({"model": sd}, tmp_path)
    for k, v in model.state_dict().items():
        assert bits(sd[k]) == bits(v) and sd[k].data_ptr() == ptrs[k], k


def test_module_and_optimizer_restore_bit_exact_into_fresh_objects(tmp_path):
    model, opt = trained()
    snapcore.save({"model": model, "optim": opt}, tmp_path, step=1)
    live = make_model()
    live_opt = torch.optim.AdamW(live.parameters(), lr=1.0)  # no per-parameter state yet
    snapcore.restore({"model": live, "optim": live_opt}, tmp_path)
    assert same_params(live, model)
    x = torch.randn(8, 16)
    for m, o in ((model, opt), (live, live_opt)):
        m(x).sum().backward()
        o.step()
    assert same_params(live, model)  # the next step is the same step


@pytest.mark.parametrize(
    ("saved", "live", "message"),
    [
        ({"w": {"a": torch.ones(2)}}, {"w": torch.zeros(2)}, "w: the snapshot holds a dict"),
        ({"w": [torch.ones(2)]}, {"w": torch.zeros(2)}, "w: the snapshot holds a list"),
        ({"w": 3}, {"w": torch.zeros(2)}, "w: the snapshot holds an int"),
        ({"w": torch.ones(2)}, {"w": {"a": torch.zeros(2)}}, "w: the snapshot holds a tensor"),
        ({"w": torch.ones(2)}, {"w": 0}, "w: the snapshot holds a tensor here but the state"),
        ({"w": [1, 2]}, {"w": torch.nn.Linear(2, 2)}, "w: the snapshot holds a list"),
        ({"w": {"x": 1}}, {"w": [0]}, "w: the snapshot holds a dict here but the state has"),
        (
            {"m": {"weight": torch.ones(3, 2), "bias": torch.ones(3)}},
            {"m": torch.nn.Linear(2, 2)},
            r"m.weight: the snapshot holds float32\[3, 2\], the state has float32\[2, 2\]",
        ),
    ],
)
def test_a_type_change_raises_naming_the_path_and_changes_nothing(tmp_path, saved, live, message):
    snapcore.save({**saved, "x": torch.ones(3), "n": 5}, tmp_path, step=1)
    state = {**live, "x": torch.zeros(3), "n": 0}
    with pytest.raises(snapcore.StateMismatch, match=message):
        snapcore.restore(state, tmp_path)
    assert torch.equal(state["x"], torch.zeros(3)) and state["n"] == 0  # nothing was written


def test_a_key_the_snapshot_lacks_raises_naming_it_before_anything_is_written(tmp_path):
    snapcore.save({"a": torch.ones(4), "n": 3}, tmp_path, step=1)
    state = {"a": torch.zeros(4), "n": 0, "b": torch.zeros(2)}
    with pytest.raises(snapcore.StateMismatch, match=r"step 1: .* nothing for b\b"):
        snapcore.restore(state, tmp_path)
    assert torch.equal(state["a"], torch.zeros(4)) and state["n"] == 0


def test_a_module_key_the_snapshot_lacks_raises_naming_it(tmp_path):
    snapcore.save({"model": torch.nn.Linear(4, 2, bias=False)}, tmp_path, step=1)
    with pytest.raises(snapcore.StateMismatch, match=r"model\.bias"):
        snapcore.restore({"model": torch.nn.Linear(4, 2)}, tmp_path)


def test_keys_the_state_lacks_are_reported_not_added(tmp_path):
    snapcore.save(
        {"a": torch.ones(2), "b": torch.ones(3), "nested": {"x": 1, "y": 2}, "l": [1, 2, 3]},
        tmp_path,
        step=1,
    )
    state: dict[str, Any] = {"a": torch.zeros(2), "nested": {"x": 0}, "l": [0, 0]}
    info = snapcore.restore(state, tmp_path)
    assert set(state) == {"a", "nested", "l"} and state["nested"] == {"x": 1}
    assert state["l"] == [1, 2, 3] and torch.equal(state["a"], torch.ones(2))  # a value
    assert info.unexpected == ["b", "nested.y"] and info.missing == []


def test_a_list_of_plain_values_takes_the_saved_one_whole(tmp_path):
    saved_rng = random.Random(7).getstate()
    snapcore.save(
        {"history": [0.5, 0.25, [1, "x"]], "short": [1], "rng": saved_rng}, tmp_path, step=1
    )
    history: list[Any] = []
    state = {"history": history, "short": [9, 9, 9], "rng": random.Random(1).getstate()}
    info = snapcore.restore(state, tmp_path)
    assert state["history"] is history and history == [0.5, 0.25, [1, "x"]]
    assert state["short"] == [1] and state["rng"] == saved_rng
    assert info.missing == [] and info.unexpected == []


def test_a_list_holding_tensors_is_matched_index_by_index(tmp_path):
    snapcore.save({"l": [torch.ones(2), torch.ones(3)]}, tmp_path, step=1)
    first = torch.zeros(2)
    state = {"l": [first]}
    info = snapcore.restore(state, tmp_path)
    assert state["l"][0] is first and torch.equal(first, torch.ones(2))
    assert len(state["l"]) == 1 and info.unexpected == ["l.1"]
    with pytest.raises(snapcore.StateMismatch, match=r"nothing for l\.2"):
        snapcore.restore({"l": [torch.zeros(2), torch.zeros(3), torch.zeros(1)]}, tmp_path)


def test_strict_false_reports_missing_and_unexpected_and_leaves_the_missing_alone(tmp_path):
    snapcore.save({"a": torch.ones(2), "old": 1, "model": torch.nn.Linear(4, 2)}, tmp_path, step=1)
    state = {"a": torch.zeros(2), "new": torch.zeros(3), "model": torch.nn.Linear(4, 2)}
    with pytest.raises(snapcore.StateMismatch):
        snapcore.restore(state, tmp_path)
    info = snapcore.restore(state, tmp_path, strict=False)
    assert info.missing == ["new"] and info.unexpected == ["old"]
    assert torch.equal(state["a"], torch.ones(2)) and torch.equal(state["new"], torch.zeros(3))
    # a module's missing keys are left as they are, its unexpected ones are not loaded
    snapcore.save({"model": {"weight": torch.ones(2, 4), "extra": torch.ones(1)}}, tmp_path, step=2)
    live = torch.nn.Linear(4, 2)
    bias = live.bias.detach().clone()
    info = snapcore.restore({"model": live}, tmp_path, strict=False)
    assert info.missing == ["model.bias"] and info.unexpected == ["model.extra"]
    assert torch.equal(live.weight, torch.ones(2, 4)) and torch.equal(live.bias, bias)


def test_a_partial_restore_reads_only_what_it_restores(tmp_path, monkeypatch):
    model, opt = trained()
    snapcore.save({"model": model, "optim": opt}, tmp_path, step=1)
    read: list[int] = []
    real = LocalTier.read_into

    def counting(self, name, offset, length, address):
        read.append(length)
        real(self, name, offset, length, address)

    monkeypatch.setattr(LocalTier, "read_into", counting)
    live = make_model()
    state = {"model": live}
    info = snapcore.restore(state, tmp_path)
    model_bytes = sum(t.nbytes for t in model.state_dict().values())
    assert sum(read) == info.bytes == model_bytes  # the optimizer's bytes were not read
    assert info.unexpected == ["optim"] and list(state) == ["model"]
    assert same_params(live, model)
    read.clear()
    full = snapcore.restore(
        {"model": make_model(), "optim": torch.optim.AdamW(live.parameters())}, tmp_path
    )
    # AdamW: exp_avg and exp_avg_sq as large as the weights, and a float32 step each
    n = len(list(model.parameters()))
    assert sum(read) == full.bytes == 3 * model_bytes + 4 * n


class Wrapped(torch.nn.Module):
    """Named like DistributedDataParallel: the model's keys carry ``module.``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    # backend="eager": a real OptimizedModule (keys "_orig_mod.*") that compiles in a
    # second; importing inductor on this torch raises a DeprecationWarning (an error here)
    c = torch.compile(model, backend="eager")
    c(torch.randn(2, 16))
    return c


@pytest.mark.parametrize("wrap", [compiled, Wrapped])
def test_wrapped_and_plain_modules_restore_into_each_other(tmp_path, wrap):
    model, opt = trained(1)
    outer = wrap(model)
    prefix = "_orig_mod." if wrap is compiled else "module."
    assert all(k.startswith(prefix) for k in outer.state_dict())
    snapcore.save({"model": outer, "optim": opt}, tmp_path, step=1)
    plain = make_model()
    plain_opt = torch.optim.AdamW(plain.parameters())
    info = snapcore.restore({"model": plain, "optim": plain_opt}, tmp_path)
    assert same_params(plain, model) and info.missing == [] and info.unexpected == []
    assert plain_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()

    other, _ = trained(2)
    snapcore.save({"model": other}, tmp_path, step=2)
    live = wrap(make_model())
    snapcore.restore({"model": live}, tmp_path)
    assert same_params(live, Wrapped(other) if wrap is Wrapped else other)


def test_a_state_dict_the_object_refuses_raises_state_mismatch(tmp_path):
    _, opt = trained()
    snapcore.save({"optim": opt}, tmp_path, step=1)
    other = torch.nn.Linear(3, 3)
    live = torch.optim.AdamW([{"params": [other.weight]}, {"params": [other.bias]}])
    with pytest.raises(snapcore.StateMismatch, match=r"optim: torch\.optim\.adamw\.AdamW"):
        snapcore.restore({"optim": live}, tmp_path)


# -- item 3: the newest step damaged ----------------------------------------------------


class Counter:
    """A stateful object that records every load_state_dict call."""

    def __init__(self) -> None:
        self.n = torch.zeros(64)
        self.loads: list[torch.Tensor] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loads.append(sd["n"].clone())
        self.n = sd["n"]


def state_at(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    counter = Counter()
    counter.n = torch.randn(64, generator=g)
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return {
        "model": model,
        "counter": counter,
        "big": torch.randn(1 << 16, generator=g),
        "step": step,
    }


def blank() -> dict[str, Any]:
    return {"model": make_model(), "counter": Counter(), "big": torch.zeros(1 << 16), "step": 0}


def assert_state(state: dict[str, Any], step: int) -> None:
    want = state_at(step)
    assert state["step"] == step
    assert same_params(state["model"], want["model"])
    assert bits(state["big"]) == bits(want["big"])
    assert bits(state["counter"].n) == bits(want["counter"].n)


def damage(tier: LocalTier | RemoteStoreTier, step: int, how: str) -> None:
    """Damage a tier's copy of ``step``: flip a byte of a chunk (found by its hash while
    reading), cut its data file short (found by its size), or break its manifest."""
    m = tier.read_manifest(step)
    if isinstance(tier, RemoteStoreTier):
        get, put = tier.rt.read_bytes, tier.rt.put_bytes
    else:

        def get(name: str) -> bytes:
            return (tier.root / name).read_bytes()

        def put(name: str, data: bytes) -> None:
            (tier.root / name).write_bytes(data)

    if how == "manifest":
        put(f"{step_dir_name(step)}/{MANIFEST}", b'{"format_version": 1, "step":')
        return
    c = m.blobs[-1].chunks[0]  # the other blobs are read intact, into the state
    name = m.files[c.file].name
    data = bytearray(get(name))
    if how == "flip":
        data[c.offset + 5] ^= 0xFF
    else:
        del data[-1:]
    put(name, bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "manifest"])
def test_a_damaged_newest_step_falls_back_to_the_older_one(tmp_path, how, caplog):
    for step in (1, 2, 3):
        snapcore.save(state_at(step), tmp_path, step=step)
    damage(engine_for(tmp_path).tier("local"), 3, how)
    state = blank()
    with caplog.at_level(logging.WARNING, logger="snapcore.api"):
        info = snapcore.restore(state, tmp_path)
    assert info.step == 2
    assert_state(state, 2)
    assert len(info.skipped) == 1 and info.skipped[0].startswith("step 3: ")
    assert any("skipping step 3" in r.getMessage() for r in caplog.records)
    # load_state_dict was called once, with the older step's data (never with partial data)
    assert len(state["counter"].loads) == 1
    assert bits(state["counter"].loads[0]) == bits(state_at(2)["counter"].n)
    with pytest.raises(snapcore.CorruptSnapshot):
        snapcore.restore(blank(), tmp_path, step=3)  # an explicit step keeps raising
    out = snapcore.load(tmp_path)  # load falls back too
    assert out["step"] == 2 and bits(out["big"]) == bits(state_at(2)["big"])
    with pytest.raises(snapcore.CorruptSnapshot):
        snapcore.load(tmp_path, step=3)


def test_the_newest_step_is_used_while_one_tier_holds_it_intact(tmp_path):
    store = snapcore.Store(local=tmp_path, remote=f"memory://snapcore-{uuid.uuid4().hex[:8]}")
    for step in (1, 2):
        snapcore.save(state_at(step), store, step=step)
    engine = engine_for(store)
    damage(engine.tier("local"), 2, "flip")
    state = blank()
    info = snapcore.restore(state, store)
    assert info.step == 2 and info.skipped == [] and info.tier == "local+remote"
    assert_state(state, 2)
    damage(engine.tier("remote"), 2, "truncate")  # now damaged in every tier
    state = blank()
    info = snapcore.restore(state, store)
    assert info.step == 1 and info.skipped[0].startswith("step 2: ")
    assert_state(state, 1)


def test_checkpointer_restore_falls_back_to_the_older_step(tmp_path):
    for step in (4, 5):
        snapcore.save(state_at(step), tmp_path, step=step)
    damage(engine_for(tmp_path).tier("local"), 5, "flip")
    ckpt = snapcore.Checkpointer(tmp_path, journal=False, handle_sigterm=False)
    state = blank()
    assert ckpt.restore(state) == 5  # step 4 restored: the next step to run is 5
    assert_state(state, 4)
    with pytest.raises(snapcore.CorruptSnapshot):
        ckpt.restore(blank(), step=5)


def test_checkpointer_restore_of_a_step_the_store_lacks_raises_instead_of_starting_at_0(tmp_path):
    snapcore.save(state_at(4), tmp_path, step=4)
    ckpt = snapcore.Checkpointer(tmp_path, journal=False, handle_sigterm=False)
    with pytest.raises(snapcore.SnapshotNotFound, match="step 7"):
        ckpt.restore(blank(), step=7)  # asked for: not "nothing to restore", step 0
    empty = snapcore.Checkpointer(tmp_path / "empty", journal=False, handle_sigterm=False)
    assert empty.restore(blank()) == 0  # an empty store is a fresh start


def test_every_step_damaged_raises_the_newest_error_naming_the_others(tmp_path):
    for step in (1, 2):
        snapcore.save(state_at(step), tmp_path, step=step)
        damage(engine_for(tmp_path).tier("local"), step, "flip")
    with pytest.raises(snapcore.CorruptSnapshot) as e:
        snapcore.restore(blank(), tmp_path)
    assert e.value.step == 2
    assert any("step 1" in note for note in e.value.__notes__)


def test_an_older_step_the_state_does_not_fit_raises_naming_the_skipped_one(tmp_path):
    snapcore.save({"a": torch.ones(2)}, tmp_path, step=1)
    snapcore.save({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path, step=2)
    damage(engine_for(tmp_path).tier("local"), 2, "manifest")
    with pytest.raises(snapcore.StateMismatch, match=r"step 1: .* nothing for b") as e:
        snapcore.restore({"a": torch.zeros(2), "b": torch.zeros(2)}, tmp_path)
    assert any("step 2: " in note for note in e.value.__notes__)


def test_a_module_the_snapshot_holds_more_layers_for_is_refused_under_strict(tmp_path):
    """Like load_state_dict(strict=True): extra keys inside a module mean a model of another
    shape. Extra top-level keys stay a partial restore (test_a_partial_restore_...)."""
    torch.manual_seed(0)
    big = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    snapcore.save({"model": big}, tmp_path, step=1)
    small = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    before = [p.detach().clone() for p in small.parameters()]
    with pytest.raises(snapcore.StateMismatch, match=r"model\.2\.weight.*another shape"):
        snapcore.restore({"model": small}, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(before, small.parameters(), strict=True))
    info = snapcore.restore({"model": small}, tmp_path, strict=False)
    assert sorted(info.unexpected) == ["model.2.bias", "model.2.weight"]
    assert torch.equal(small[1].weight, big[1].weight)
