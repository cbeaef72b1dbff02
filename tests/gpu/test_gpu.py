"""The CUDA staging path through the public API (skipped, with the reason, without a GPU)."""

from __future__ import annotations

import threading

import pytest
import torch

import snapcore
from snapcore import _native
from snapcore.write import engine as engine_mod

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (_native.cuda_available() and torch.cuda.is_available()),
        reason=f"no CUDA device ({_native.cuda_status()})",
    ),
]


def test_cuda_state_round_trips_and_restores_in_place(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 128).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "t": torch.randn(3, 5, device="cuda").t()}
    stats = snapcore.save(state, tmp_path, step=1)
    assert engine_mod.engine_for(tmp_path).arenas[0].native.pinned
    assert stats.bytes > 0
    out = snapcore.load(tmp_path)
    assert out["model"]["weight"].device.type == "cpu"
    assert torch.equal(out["model"]["weight"], model.weight.cpu())
    assert torch.equal(out["t"], state["t"].cpu())

    model2 = torch.nn.Linear(256, 128).cuda()
    opt2 = torch.optim.Adam(model2.parameters())
    ptr = model2.weight.data_ptr()
    snapcore.restore(
        {"model": model2, "optim": opt2, "t": torch.zeros(5, 3, device="cuda")}, tmp_path
    )
    assert model2.weight.data_ptr() == ptr and model2.weight.device.type == "cuda"
    assert torch.equal(model2.weight, model.weight)
    exp = opt2.state_dict()["state"][0]["exp_avg"]
    assert exp.device.type == "cuda" and torch.equal(exp, opt.state_dict()["state"][0]["exp_avg"])


def test_cuda_async_default_mode_is_isolated(tmp_path):
    t = torch.arange(1 << 22, device="cuda", dtype=torch.float32)
    h = snapcore.async_save({"t": t}, tmp_path, step=1)
    t.add_(1)  # queued on the current stream after async_save returned
    h.wait()
    assert torch.equal(snapcore.load(tmp_path)["t"], torch.arange(1 << 22, dtype=torch.float32))


def test_cuda_overlap_optimizer_step_cannot_race_the_copies(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096).cuda()  # 64 MiB of weights: the copy takes a while
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    before = model.weight.detach().clone()
    # Keep the side stream busy so the copies are still queued when step() runs.
    torch.cuda._sleep(50_000_000)
    h = snapcore.async_save({"m": model, "o": opt}, tmp_path, step=1, overlap=True)
    opt.step()  # the pre-hook makes the current stream wait for the copies
    h.wait()
    assert torch.equal(snapcore.load(tmp_path)["m"]["weight"], before.cpu())
    assert not torch.equal(model.weight, before)


def test_restore_to_the_gpu_goes_through_the_pinned_ring_not_torch_pinned_buffers(
    tmp_path, monkeypatch
):
    """Contiguous CUDA tensors are filled by the native path (staging/h2d.py): chunks read
    into a registered ring, host-to-device copies on the side stream; torch's pinned
    allocator (which caches power-of-two blocks for the life of the process) is not used."""
    g = torch.Generator().manual_seed(0)
    saved = {
        "a": torch.randn(3 << 20, generator=g).cuda(),
        "b": torch.randn(333, generator=g).to(torch.bfloat16).cuda(),
        "c": torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g).cuda(),
    }
    snapcore.save(saved, tmp_path, step=1)
    pinned: list[object] = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            pinned.append(args)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    targets = {k: torch.zeros_like(v) for k, v in saved.items()}
    snapcore.restore(targets, tmp_path)
    for k, v in saved.items():
        assert torch.equal(targets[k], v), k
    assert pinned == []


def test_restore_through_the_native_gpu_path_bumps_the_version_counter(tmp_path):
    """The native copier writes a contiguous CUDA tensor through its device address, which
    torch does not see: restore bumps its version counter (as copy_ would), so that
    autograd refuses a backward through a graph that saved the old values."""
    saved = torch.randn(1 << 16, device="cuda")
    snapcore.save({"t": saved}, tmp_path, step=1)
    target = torch.zeros_like(saved)
    x = torch.ones_like(saved, requires_grad=True)
    y = (target * x).sum()  # saves target for x's gradient
    before = target._version
    snapcore.restore({"t": target}, tmp_path)
    assert torch.equal(target, saved)
    assert target._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_restore_into_a_strided_gpu_tensor(tmp_path):
    x = torch.randn(64, 48, device="cuda")
    snapcore.save({"x": x}, tmp_path, step=1)
    target = torch.zeros(48, 64, device="cuda").t()  # not contiguous: the torch copy path
    snapcore.restore({"x": target}, tmp_path)
    assert torch.equal(target, x)


def test_cuda_overlap_step_does_not_wait_for_the_previous_snapshots_persist(
    tmp_path, host_name, monkeypatch
):
    """For CUDA tensors the optimizer's step only makes the current stream wait for the
    copies: it returns while the previous snapshot's local commit is still held."""
    from snapcore.write.job import PersistJob

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    before = model.weight.detach().clone()
    gate, order = threading.Event(), []
    real_commit = PersistJob._commit_local

    def held_commit(self, m):
        if self.handle.step == 1 and not gate.wait(60):
            order.append("gate timed out")
        real_commit(self, m)

    monkeypatch.setattr(PersistJob, "_commit_local", held_commit)
    store = snapcore.Store(host=host_name, local=tmp_path)
    h1 = snapcore.async_save({"m": model, "o": opt}, store, step=1)
    h2 = snapcore.async_save({"m": model, "o": opt}, store, step=2, overlap=True)
    opt.step()  # with step 1's commit held: returns only if it does not wait for it
    order.append("stepped")
    gate.set()
    h1.wait()
    h2.wait()
    assert order == ["stepped"], order
    assert torch.equal(snapcore.load(store, step=2)["m"]["weight"], before.cpu())
    assert not torch.equal(model.weight, before)


def test_overlap_mode_is_refused_inside_cuda_graph_capture(tmp_path):
    model = torch.nn.Linear(16, 16).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks
        model(x).sum()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(snapcore.SnapcoreError, match="CUDA graph"), torch.cuda.graph(graph):
        model(x).sum()
        snapcore.async_save({"m": model, "o": opt}, tmp_path, step=1, overlap=True)
    assert snapcore.committed(tmp_path)["local"] == []
