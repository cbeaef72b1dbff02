"""save / async_save / restore / load: round trips, semantics, errors."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

import snapcore
from snapcore import _native
from snapcore.directory import LocalDirectory
from snapcore.staging.copy import Stager
from snapcore.write import engine as engine_mod

CPU_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor with random bit patterns (NaNs and all), so equality is bitwise."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().view(shape)
    return raw.view(dtype).view(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def test_every_dtype_round_trips_bit_exact(tmp_path):
    state = {
        str(d).removeprefix("torch."): random_bits((3, 5), d, i) for i, d in enumerate(CPU_DTYPES)
    }
    state["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    state["empty"] = torch.empty(0, 4, dtype=torch.float32)
    snapcore.save(state, tmp_path, step=1)
    loaded = snapcore.load(tmp_path)
    for k, v in state.items():
        assert same_bits(loaded[k], v), k
    assert loaded["scalar"].shape == ()
    assert loaded["empty"].shape == (0, 4)


def test_restore_fills_existing_tensors_in_place(tmp_path):
    src = {
        name: random_bits((4, 7), d, 9) for name, d in [("a", torch.float32), ("b", torch.int64)]
    }
    snapcore.save(src, tmp_path, step=2)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    ptrs = {k: v.data_ptr() for k, v in dst.items()}
    info = snapcore.restore(dst, tmp_path)
    assert info.step == 2
    for k in src:
        assert dst[k].data_ptr() == ptrs[k]
        assert same_bits(dst[k], src[k])


def test_non_contiguous_views_and_tied_tensors(tmp_path):
    base = torch.arange(60, dtype=torch.float32).view(6, 10)
    emb = torch.nn.Embedding(10, 6)
    head = torch.nn.Linear(6, 10, bias=False)
    head.weight = emb.weight  # tied weights
    state = {
        "t": base.t(),  # a transposed view alone on its storage
        "strided": base[::2, 1::3],
        "a": base[0],
        "b": base[1:3],  # two views of one storage: saved once
        "emb": emb,
        "head": head,
        "same": [base[0], base[0]],
    }
    snapcore.save(state, tmp_path, step=3)
    out = snapcore.load(tmp_path)
    assert torch.equal(out["t"], base.t())
    assert torch.equal(out["strided"], base[::2, 1::3])
    assert torch.equal(out["a"], base[0]) and torch.equal(out["b"], base[1:3])
    # views of one storage come back sharing storage
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
    out["a"][0] = -1.0
    assert out["same"][0][0] == -1.0  # identical views are one tensor
    # tied weights come back tied
    assert out["emb"]["weight"] is out["head"]["weight"]
    # restore into fresh modules keeps them tied (the state ties them)
    emb2, head2 = torch.nn.Embedding(10, 6), torch.nn.Linear(6, 10, bias=False)
    head2.weight = emb2.weight
    snapcore.restore({"emb": emb2, "head": head2}, tmp_path)
    assert torch.equal(emb2.weight, emb.weight) and head2.weight is emb2.weight


def test_module_optimizer_scheduler_round_trip(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    state = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "step": 3,
        "data": {"epoch": 1, "pos": 17},
    }
    snapcore.save(state, tmp_path, step=3)

    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    # the live state is the schema: its keys are filled (restore adds none)
    data2 = {"epoch": 0, "pos": 0}
    state2 = {"model": model2, "optim": opt2, "sched": sched2, "step": 0, "data": data2}
    info = snapcore.restore(state2, tmp_path)
    assert info.step == 3 and state2["step"] == 3 and state2["data"] == {"epoch": 1, "pos": 17}
    assert state2["data"] is data2 and info.missing == [] and info.unexpected == []
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert sched2.state_dict() == sched.state_dict()
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for k in s1:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1[k][name], s2[k][name])
    # the next step is identical
    x = torch.randn(4, 8)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_python_values_round_trip_exactly(tmp_path):
    values = {
        "ints": [0, -1, 2**70, 5],
        "floats": (0.1, -0.0, float("inf"), float("-inf"), 1e-310),
        "nan": float("nan"),
        "s": "ünïcode",
        "none": None,
        "flags": [True, False],
        3: "int key",
    }
    snapcore.save(values, tmp_path, step=0)
    out = snapcore.load(tmp_path)
    assert out["ints"] == values["ints"] and isinstance(out["floats"], tuple)
    assert [x.hex() for x in out["floats"]] == [x.hex() for x in values["floats"]]
    assert math.isnan(out["nan"]) and out[3] == "int key" and out["s"] == values["s"]
    assert out["flags"] == [True, False] and out["none"] is None


class Opaque:
    pass


@pytest.mark.parametrize(
    ("state", "path"),
    [
        ({"optim": {"foo": {"bar": Opaque()}}}, "optim.foo.bar"),
        ({"a": [1, 2, {3.5: 1}]}, "a.2.3.5"),
        ({"x": bytearray(b"bytes")}, "x"),  # bytes are saved; bytearray is not
        ({"s": {1, 2}}, "s"),
    ],
)
def test_unsupported_leaf_names_its_path(tmp_path, state, path):
    with pytest.raises(snapcore.UnsupportedState) as e:
        snapcore.save(state, tmp_path, step=1)
    assert e.value.path == path
    assert path in str(e.value)
    assert LocalDirectory(tmp_path).committed_steps() == []


def test_restore_newest_and_by_step_and_not_found(tmp_path):
    with pytest.raises(snapcore.SnapshotNotFound):
        snapcore.restore({"x": torch.zeros(2)}, tmp_path)
    for step in (2, 10, 9):  # numeric, not lexical, ordering
        snapcore.save({"x": torch.full((2,), float(step))}, tmp_path, step=step)
    state = {"x": torch.zeros(2)}
    assert snapcore.restore(state, tmp_path).step == 10 and state["x"][0] == 10
    assert snapcore.restore(state, tmp_path, step=2).step == 2 and state["x"][0] == 2
    with pytest.raises(snapcore.SnapshotNotFound, match="step 3"):
        snapcore.load(tmp_path, step=3)


def test_restore_shape_mismatch_is_clear(tmp_path):
    snapcore.save({"w": torch.zeros(3, 4)}, tmp_path, step=1)
    with pytest.raises(snapcore.StateMismatch, match=r"w: the snapshot holds float32\[3, 4\]"):
        snapcore.restore({"w": torch.zeros(4, 3)}, tmp_path)


def test_async_save_default_mode_snapshot_is_isolated_from_later_changes(tmp_path):
    t = torch.arange(1 << 20, dtype=torch.float32)
    h = snapcore.async_save({"t": t}, tmp_path, step=1)
    t.add_(1)  # the state may change as soon as async_save returns
    stats = h.wait()
    assert h.done() and h.step == 1 and stats.durable_s >= stats.staged_s > 0
    assert torch.equal(snapcore.load(tmp_path)["t"], torch.arange(1 << 20, dtype=torch.float32))


def test_resaving_a_committed_step_replaces_it_atomically(tmp_path):
    snapcore.save({"x": torch.zeros(4)}, tmp_path, step=5)
    snapcore.save({"x": torch.ones(4)}, tmp_path, step=5)
    snapcore.wait_all(tmp_path)  # the replaced files are collected after the commit
    assert torch.equal(snapcore.load(tmp_path)["x"], torch.ones(4))
    step_dir = next(tmp_path.iterdir())
    assert len(list(step_dir.glob("*.bin"))) == 1  # the old data file was collected


def _hold_overlap_copies(
    monkeypatch, gate: threading.Event, order: list[str], started: threading.Event | None = None
) -> None:
    """Overlap mode's CPU copies (on the snapcore-overlap thread) wait for ``gate`` (60 s at
    most), then run and append "copied" to ``order``; ``started`` is set when they begin."""
    real_copy = _native.copy_host

    def held_copy(copies, threads=0, **kw):
        if threading.current_thread().name.startswith("snapcore-overlap"):
            if started is not None:
                started.set()
            gate.wait(60)
            real_copy(copies, threads, **kw)
            order.append("copied")
        else:
            real_copy(copies, threads, **kw)

    monkeypatch.setattr(_native, "copy_host", held_copy)


def _on_copy_wait(monkeypatch, event: threading.Event, thread: str) -> None:
    """Set ``event`` when a thread whose name starts with ``thread`` calls ``result()`` on a
    future of overlap mode's CPU copies (those ``Stager._run_deferred`` makes: the one
    ``SaveHandle.staged()``, the optimizer's step, waits on, and the one in ``w.pending``
    the persist thread waits on). With the copies held on a gate, a test releases them
    once the waiter is waiting for them, or has gone on without: no timed wait, and a
    waiter that does not wait is caught whatever the machine's speed."""
    real = Stager._run_deferred

    def watch(fut):
        result = fut.result

        def watched(timeout=None):
            if threading.current_thread().name.startswith(thread):
                event.set()
            return result(timeout)

        fut.result = watched

    def run_deferred(self, w, events, handle):
        host = real(self, w, events, handle)
        watch(host)
        watch(w.pending[-1])
        return host

    monkeypatch.setattr(Stager, "_run_deferred", run_deferred)


def _step_in_thread(opt, order: list[str], done: threading.Event) -> threading.Thread:
    """``opt.step()`` on a thread named "stepper", which appends "stepped" to ``order`` and
    sets ``done`` after it."""

    def step() -> None:
        opt.step()
        order.append("stepped")
        done.set()

    stepper = threading.Thread(target=step, name="stepper")
    stepper.start()
    return stepper


def test_overlap_mode_optimizer_step_waits_for_the_copies(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(8, 64)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    order: list[str] = []
    gate, waiting = threading.Event(), threading.Event()
    _hold_overlap_copies(monkeypatch, gate, order)
    _on_copy_wait(monkeypatch, waiting, "stepper")
    h = snapcore.async_save({"model": model, "optim": opt}, tmp_path, step=1, overlap=True)
    assert not h._staged.is_set()  # it returned before copying the parameters (held)
    stepper = _step_in_thread(opt, order, waiting)
    # the step waits for the copies (the pre-hook), or went on without: then the copies run
    assert waiting.wait(60), "the step neither waited for the copies nor went on"
    gate.set()
    stepper.join(120)
    assert not stepper.is_alive()
    h.wait()
    assert order == ["copied", "stepped"], order
    saved = snapcore.load(tmp_path)["model"]
    for k, v in before.items():
        assert torch.equal(saved[k], v), k
    assert not torch.equal(model.weight, before["weight"])  # the step did happen


def test_overlap_mode_step_waits_for_the_cpu_copies_not_for_the_previous_persist(
    tmp_path, host_name, monkeypatch
):
    """The optimizer's step waits for overlap mode's CPU copies (on a thread of their own),
    never for the persist thread, which may still be writing the previous snapshot."""
    from snapcore.write.job import PersistJob

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(8, 64)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    order: list[str] = []
    persist_gate, copy_gate = threading.Event(), threading.Event()
    copying, waiting = threading.Event(), threading.Event()
    real_commit = PersistJob._commit_local

    def held_commit(self, m):  # step 1's local commit waits (at most 60 s) for the gate
        if self.handle.step == 1 and not persist_gate.wait(60):
            order.append("persist gate timed out")
        real_commit(self, m)

    monkeypatch.setattr(PersistJob, "_commit_local", held_commit)
    _hold_overlap_copies(monkeypatch, copy_gate, order, started=copying)
    _on_copy_wait(monkeypatch, waiting, "stepper")
    store = snapcore.Store(host=host_name, local=tmp_path)
    h1 = snapcore.async_save({"model": model, "optim": opt}, store, step=1)
    h2 = snapcore.async_save({"model": model, "optim": opt}, store, step=2, overlap=True)
    stepper = _step_in_thread(opt, order, waiting)  # the pre-hook: waits for step 2's copies
    assert copying.wait(60), "overlap mode's CPU copies never started on their own thread"
    # the step waits for the copies, or went on without; step 1's persist is still held
    assert waiting.wait(60), "the step neither waited for the copies nor went on"
    copy_gate.set()
    stepper.join(120)
    assert not stepper.is_alive()
    order.append("persist released")
    persist_gate.set()
    h1.wait()
    h2.wait()
    assert order == ["copied", "stepped", "persist released"], order
    saved = snapcore.load(store, step=2)["model"]
    for k, v in before.items():
        assert torch.equal(saved[k], v), k
    assert not torch.equal(model.weight, before["weight"])


def test_overlap_mode_failed_persist_frees_the_arena_only_after_the_copies(tmp_path, monkeypatch):
    """The persist thread fails before it takes the window (here: the store cannot be
    opened) while overlap mode's CPU copies still write into the arena: the arena's slot
    is freed, for the next save to stage into, only once those copies have finished."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(8, 64)).sum().backward()
    order: list[str] = []
    gate, progress = threading.Event(), threading.Event()
    real_begin = LocalDirectory.begin

    def failing_begin(self, step):
        if step == 1:
            raise OSError(5, "the store cannot be opened")
        return real_begin(self, step)

    _hold_overlap_copies(monkeypatch, gate, order)
    _on_copy_wait(monkeypatch, progress, "snapcore-persist")
    monkeypatch.setattr(LocalDirectory, "begin", failing_begin)
    h = snapcore.async_save({"model": model, "optim": opt}, tmp_path, step=1, overlap=True)
    h.settle()  # failed: the persist thread is past its failure
    slot_free = engine_mod.engine_for(tmp_path)._slot_free[0]
    assert slot_free is not None

    def freed(_) -> None:
        order.append("slot freed")
        progress.set()

    slot_free.add_done_callback(freed)
    # the persist thread waits for the held copies before it frees the slot, or freed it
    # without: only then are the copies let go (a wrong order shows, on any machine)
    assert progress.wait(60), "the persist thread neither waited for the copies nor freed"
    gate.set()
    slot_free.result(timeout=60)
    assert order == ["copied", "slot freed"], order
    with pytest.raises(snapcore.SnapshotFailed, match="cannot be opened"):
        h.wait()
    opt.step()  # the hook does not hang on the failed snapshot
    snapcore.async_save({"model": model, "optim": opt}, tmp_path, step=2).wait()
    assert snapcore.committed(tmp_path)["local"] == [2]


def test_overlap_mode_is_refused_while_a_cuda_graph_is_captured(tmp_path, monkeypatch):
    """The copies' ordering and the hook's stream wait would be captured, not run."""
    model = torch.nn.Linear(4, 4)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(snapcore.SnapcoreError, match="CUDA graph is being captured"):
        snapcore.async_save(state, tmp_path, step=1, overlap=True)
    assert snapcore.committed(tmp_path)["local"] == []  # nothing was staged or written
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    snapcore.async_save(state, tmp_path, step=1, overlap=True).wait()
    assert snapcore.committed(tmp_path)["local"] == [1]


def test_overlap_mode_copies_non_optimizer_tensors_before_returning(tmp_path, monkeypatch):
    model = torch.nn.BatchNorm1d(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    order: list[str] = []
    gate = threading.Event()
    _hold_overlap_copies(monkeypatch, gate, order)  # the parameters' copies wait
    h = snapcore.async_save({"model": model, "optim": opt}, tmp_path, step=1, overlap=True)
    model.running_mean.add_(5)  # a buffer the forward pass writes: not protected by the hook
    gate.set()  # a buffer left to the deferred copies would be read only now
    h.wait()
    assert order == ["copied"]  # the parameters' copies were deferred indeed
    assert torch.equal(snapcore.load(tmp_path)["model"]["running_mean"], torch.zeros(4))


def test_explicit_staged_wait(tmp_path, monkeypatch):
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model.weight.detach().clone()
    order: list[str] = []
    gate, waiting = threading.Event(), threading.Event()
    _hold_overlap_copies(monkeypatch, gate, order)
    _on_copy_wait(monkeypatch, waiting, "MainThread")
    # the copies are let go once staged() waits for them, or once the weight is changed
    releaser = threading.Thread(target=lambda: (waiting.wait(60), gate.set()))
    releaser.start()
    h = snapcore.async_save({"m": model, "o": opt}, tmp_path, step=1, overlap=True)
    h.staged()
    with torch.no_grad():
        model.weight.zero_()
    waiting.set()
    releaser.join(60)
    h.wait()
    assert order == ["copied"]
    assert torch.equal(snapcore.load(tmp_path)["m"]["weight"], before)


def test_budget_streams_and_bounds_the_arena(tmp_path):
    tensors = {f"t{i}": random_bits((3 << 20,), torch.float32, i) for i in range(4)}  # 48 MiB
    tensors["strided"] = random_bits((2048, 1024), torch.float32, 7).t()
    budget = 20 << 20
    stats = snapcore.save(tensors, tmp_path, step=1, budget_bytes=budget)
    assert stats.streaming
    eng = engine_mod.engine_for(tmp_path)
    assert eng.arenas[0] is not None and eng.arenas[0].size <= budget
    out = snapcore.load(tmp_path)
    for k, v in tensors.items():
        assert same_bits(out[k], v), k


def test_background_failure_surfaces_on_wait_and_next_save(tmp_path, monkeypatch):
    class Boom(OSError):
        pass

    real = _native.FileWriter

    def failing(*a, **k):
        raise Boom(28, "No space left on device", "fake")

    snapcore.save({"x": torch.ones(3)}, tmp_path, step=1)
    monkeypatch.setattr(_native, "FileWriter", failing)
    h = snapcore.async_save({"x": torch.zeros(3)}, tmp_path, step=2)
    with pytest.raises(snapcore.SnapshotFailed, match="step 2") as e:
        h.wait()
    assert isinstance(e.value.__cause__, Boom)
    # not waited on: the next save reports it, once
    h = snapcore.async_save({"x": torch.zeros(3)}, tmp_path, step=3)
    with pytest.raises(snapcore.SnapshotFailed, match="step 3"):
        snapcore.async_save({"x": torch.zeros(3)}, tmp_path, step=4)
    monkeypatch.setattr(_native, "FileWriter", real)
    snapcore.save({"x": torch.full((3,), 5.0)}, tmp_path, step=5)
    # the committed snapshots are untouched; the failed ones left nothing behind
    store = LocalDirectory(tmp_path)
    assert store.committed_steps() == [1, 5]
    assert [s.step for s in store.snapshots()] == [1, 5]
    assert torch.equal(snapcore.load(tmp_path, step=1)["x"], torch.ones(3))


def test_async_saves_in_a_row_reuse_the_arena(tmp_path):
    t = torch.randn(1 << 18)
    handles = [snapcore.async_save({"t": t}, tmp_path, step=s) for s in range(3)]
    arena = engine_mod.engine_for(tmp_path).arenas[0]
    for h in handles:
        h.wait()
    assert engine_mod.engine_for(tmp_path).arenas[0] is arena
    assert LocalDirectory(tmp_path).committed_steps() == [0, 1, 2]


def test_concurrent_saves_from_threads_are_serialised(tmp_path):
    errors: list[BaseException] = []
    store = snapcore.Store(local=tmp_path, retention={"local": 0})  # keep every step

    def worker(k: int) -> None:
        try:
            snapcore.save({"v": torch.full((1000,), float(k))}, store, step=k)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for k in range(4):
        assert snapcore.load(store, step=k)["v"][0] == k


def test_interrupted_streaming_resave_keeps_the_committed_step(tmp_path, monkeypatch):
    big = {f"t{i}": random_bits((1 << 20,), torch.float32, i) for i in range(3)}  # 12 MiB
    snapcore.save(big, tmp_path, step=5)
    real = Stager.copy
    calls = 0

    def copy(self, blobs, w, **kw):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt  # Ctrl-C while the second window is staged
        return real(self, blobs, w, **kw)

    monkeypatch.setattr(Stager, "copy", copy)
    with pytest.raises(KeyboardInterrupt):
        snapcore.async_save(
            {k: v + 1 for k, v in big.items()}, tmp_path, step=5, budget_bytes=8 << 20
        )
    monkeypatch.setattr(Stager, "copy", real)
    # the interrupt reached the caller: it does not fail the next save as well
    snapcore.save({"x": torch.ones(1)}, tmp_path, step=6)
    assert LocalDirectory(tmp_path).committed_steps() == [5, 6]
    out = snapcore.load(tmp_path, step=5)
    for k, v in big.items():
        assert same_bits(out[k], v), k


def test_a_save_that_raised_does_not_poison_the_next(tmp_path, monkeypatch):
    with pytest.raises(snapcore.SnapcoreError, match="meta"):
        snapcore.save({"w": torch.empty(3, device="meta")}, tmp_path, step=2)
    # the caller was told: the next good save goes through and is restorable
    snapcore.save({"w": torch.ones(3)}, tmp_path, step=3)
    state = {"w": torch.zeros(3)}
    assert snapcore.restore(state, tmp_path).step == 3
    assert torch.equal(state["w"], torch.ones(3))

    # a failure in the background that nobody saw is still raised, once, by the next save
    def failing(*a, **k):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(_native, "FileWriter", failing)
    h = snapcore.async_save({"w": torch.zeros(3)}, tmp_path, step=4)
    deadline = time.monotonic() + 60
    while not h.done() and time.monotonic() < deadline:  # done() tells nobody of it
        time.sleep(0.005)
    assert h.done()
    monkeypatch.undo()
    with pytest.raises(snapcore.SnapshotFailed, match="step 4"):
        snapcore.save({"w": torch.full((3,), 5.0)}, tmp_path, step=5)
    snapcore.save({"w": torch.full((3,), 6.0)}, tmp_path, step=6)
    assert LocalDirectory(tmp_path).committed_steps() == [3, 6]


def test_errors_after_a_commit_are_warnings_not_failures(tmp_path, monkeypatch):
    store = snapcore.Store(local=tmp_path, retention={"local": 1})
    snapcore.save({"x": torch.zeros(4)}, store, step=1)

    def broken(self, step):
        raise OSError(5, "Input/output error (simulated)")

    monkeypatch.setattr(snapcore.tiers.LocalTier, "uncommit", broken)
    stats = snapcore.save({"x": torch.ones(4)}, store, step=2)
    snapcore.wait_all(store)  # retention runs after the commit
    assert any("simulated" in w for w in stats.warnings)
    assert torch.equal(snapcore.load(tmp_path, step=2)["x"], torch.ones(4))
    assert torch.equal(snapcore.load(tmp_path, step=1)["x"], torch.zeros(4))


def test_a_failure_is_reported_once_not_once_per_tier(tmp_path, monkeypatch):
    import uuid

    store = snapcore.Store(local=tmp_path, remote=f"memory://snapcore-{uuid.uuid4().hex[:8]}")

    def failing(*a, **k):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(_native, "FileWriter", failing)
    h = snapcore.async_save({"x": torch.ones(8)}, store, step=1)
    with pytest.raises(snapcore.SnapshotFailed) as e:
        h.wait()  # one error failed both tiers
    assert e.value.tier == "local"
    with pytest.raises(snapcore.SnapshotFailed):
        h.wait(tier="remote")  # asking again still raises...
    monkeypatch.undo()
    snapcore.save({"x": torch.ones(8)}, store, step=2)  # ...but it is not reported again
    assert snapcore.committed(store) == {"local": [2], "remote": [2]}


def test_stale_chunk_index_is_rebuilt_after_an_outside_gc(tmp_path):
    from snapcore.cli import main

    frozen = torch.randn(1 << 16)
    snapcore.save({"f": frozen, "c": torch.tensor(1)}, tmp_path, step=1)
    snapcore.save({"f": frozen, "c": torch.tensor(2)}, tmp_path, step=2)
    assert main(["gc", str(tmp_path), "--retention", "local=1"]) == 0  # "another process"
    snapcore.save({"f": frozen, "c": torch.tensor(1)}, tmp_path, step=3)
    out = snapcore.load(tmp_path, step=3)
    assert torch.equal(out["f"], frozen) and out["c"] == 1


def test_prepare_faults_the_arena_before_the_first_save(tmp_path):
    state = {"t": torch.randn(1 << 20)}
    fut = snapcore.prepare(state, tmp_path)
    fut.result(timeout=60)
    arena = engine_mod.engine_for(tmp_path).arenas[0]
    assert arena is not None and arena.size >= 4 << 20
    snapcore.save(state, tmp_path, step=1)
    assert engine_mod.engine_for(tmp_path).arenas[0] is arena  # used, not made again
    assert snapcore.prepare(state, tmp_path).result(timeout=1) is None  # nothing to do
