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


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes on the CPU, in its logical order (compares fp8, bool, 0-d alike)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _views_and_dtypes() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CUDA tensors of the dtypes and layouts staging must copy bit-exact: bf16, both fp8
    formats, bool, float64 0-d, empty; contiguous views at a storage offset, strided and
    transposed views, a 2-d slice with a step. Two of them are views into ``base``."""
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(1 << 20, device="cuda", generator=g)
    state = {
        "bf16": torch.randn(1000, 77, device="cuda", generator=g).to(torch.bfloat16),
        "e4m3": torch.randn(513, device="cuda", generator=g).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(129, 3, device="cuda", generator=g).to(torch.float8_e5m2),
        "offset": base[12345 : 12345 + 4097],  # contiguous, at a storage offset
        "strided": base[: 4096 * 2].view(4096, 2)[:, 1],  # every other element
        "transposed": torch.randn(64, 48, device="cuda", generator=g).t(),
        "slice2d": torch.randn(256, 256, device="cuda", generator=g)[3:200:3, 7:100],
        "bool": torch.rand(1000, device="cuda", generator=g) > 0.5,
        "empty": torch.empty(0, 5, device="cuda"),
        "scalar": torch.tensor(3.5, device="cuda", dtype=torch.float64),
    }
    return base, state


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_dtypes_and_views_round_trip_bit_exact(tmp_path, overlap):
    """bf16/fp8 tensors and non-contiguous and offset views on the device are staged
    bit-exact (load), and restored in place into the same views without writing a byte
    of their storage outside them."""
    base, state = _views_and_dtypes()
    expected = {k: _bits(v) for k, v in state.items()}
    snapcore.async_save(state, tmp_path, step=1, overlap=overlap).wait()
    out = snapcore.load(tmp_path)
    for k, v in state.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
        assert torch.equal(_bits(out[k]), expected[k]), k

    with torch.no_grad():
        base.zero_()
        for v in state.values():
            if v._base is not base:  # fp8 through its bytes: fill kernels may lack it
                (v.view(torch.uint8) if v.element_size() == 1 else v).zero_()
    info = snapcore.restore(state, tmp_path)
    assert info.step == 1
    for k, v in state.items():
        assert v.device.type == "cuda" and torch.equal(_bits(v), expected[k]), k
    # base's elements outside the two views are as the zeroing left them
    outside = torch.ones(base.numel(), dtype=torch.bool, device="cuda")
    outside[12345 : 12345 + 4097] = False
    outside[1 : 4096 * 2 : 2] = False
    assert not base[outside].any()


def test_an_optimizer_tensor_freed_while_its_copy_is_queued_is_saved_as_it_was(tmp_path):
    """Overlap mode queues the copies of the optimizer's tensors and returns before they
    ran. A state tensor the caller drops then (its block back in the caching allocator,
    handed to the next allocation of its size on the same stream and overwritten there)
    must still be saved with the values it had at the call: snapcore holds a reference to
    every source until its copy has run."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048).cuda()  # 16 MiB of weights and of each moment
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 2048, device="cuda")).sum().backward()
    opt.step()
    st = opt.state[model.weight]
    expected = st["exp_avg"].cpu()
    torch.cuda._sleep(200_000_000)  # the side stream's copies wait behind this
    h = snapcore.async_save({"m": model, "o": opt}, tmp_path, step=1, overlap=True)
    st["exp_avg"] = torch.zeros_like(st["exp_avg"])  # the caller's last reference to it
    reused = [torch.full_like(expected, 7.0, device="cuda") for _ in range(4)]
    h.wait()
    del reused
    model2 = torch.nn.Linear(2048, 2048).cuda()
    opt2 = torch.optim.Adam(model2.parameters())
    snapcore.restore({"m": model2, "o": opt2}, tmp_path)
    assert torch.equal(opt2.state[model2.weight]["exp_avg"].cpu(), expected)


def test_copies_are_ordered_after_the_callers_current_stream(tmp_path):
    """Work queued on the current stream before the call, on a stream that is not the
    default one, is in the snapshot; and a tensor written on another stream that the
    current stream was made to wait for (as torch asks of such code) is too."""
    n = 1 << 22
    user = torch.cuda.Stream()
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        w = torch.zeros(n, device="cuda")
        torch.cuda._sleep(100_000_000)
        w.fill_(5.0)
    with torch.cuda.stream(user):
        t = torch.zeros(n, device="cuda")
        torch.cuda._sleep(100_000_000)
        t.fill_(3.0)  # pending on `user` when async_save is called
        user.wait_stream(other)
        h = snapcore.async_save({"t": t, "w": w}, tmp_path, step=1)
    h.wait()
    out = snapcore.load(tmp_path)
    assert torch.equal(out["t"], torch.full((n,), 3.0))
    assert torch.equal(out["w"], torch.full((n,), 5.0))


def test_restore_is_ordered_after_and_before_the_restoring_threads_current_stream(tmp_path):
    """Restore inside ``torch.cuda.stream(user)``: the copies (queued by the restore's
    worker threads, whose own current stream is the default one) wait for the work
    already on ``user`` (a late ``zero_`` does not overwrite them), and ``user`` waits for
    them (a read queued on it after the restore sees the restored values)."""
    n = 1 << 26  # 256 MiB: 4 chunks, batches of the ring read by several workers
    saved = torch.randn(n, device="cuda")
    snapcore.save({"t": saved}, tmp_path, step=1)
    target = torch.ones(n, device="cuda")
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(user):
        torch.cuda._sleep(2_000_000_000)  # about a second: longer than the reads
        target.zero_()  # pending on `user` when the restore starts
        snapcore.restore({"t": target}, tmp_path)
        total = target.sum()  # queued on `user` after the restore
    user.synchronize()
    assert torch.equal(target, saved)
    assert torch.equal(total, saved.sum())


DEVICE_FAILURE = r"""
import sys, torch, snapcore
root = sys.argv[1]
model = torch.nn.Linear(1024, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(4, 1024, device="cuda")).sum().backward()
opt.step()
torch.cuda._sleep(50_000_000)
bad = model.weight.view(-1)[torch.tensor([1 << 40], device="cuda")]  # a device-side assert
where = "async_save"
try:
    h = snapcore.async_save({"m": model, "o": opt}, root, step=1, overlap=True)
    where = "wait"
    h.wait(timeout=120)
except Exception as e:
    print(f"raised in {where}: {type(e).__module__}.{type(e).__name__}: {e}")
else:
    print("no error")
print("committed:", snapcore.committed(root)["local"])
"""


def test_a_device_side_failure_surfaces_and_commits_nothing(tmp_path):
    """A kernel that fails on the device (a device-side assert: CUDA's sticky error) before
    the copies ran makes the save fail with an error naming CUDA, on the call or on the
    handle, within the wait's timeout, and nothing is committed. In a child process: the
    error ends its CUDA context."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", DEVICE_FAILURE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    assert "no error" not in out, out + proc.stderr
    raised = next((ln for ln in out.splitlines() if ln.startswith("raised in ")), None)
    assert raised is not None, out + proc.stderr
    assert "cuda" in raised.lower(), raised  # the error names what failed
    assert "committed: []" in out, out + proc.stderr
