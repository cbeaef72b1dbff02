"""Rank script for the sharded-snapshot tests: argv[1] is a JSON list of actions, run in
order; the report holds one entry per action.

  {"op": "save", "kind": K, "store": DIR, "step": N, "seed": S}
      build model K (seed S, two AdamW steps), save {"app": AppState, "step": N,
      "rng": RNGState(), "data": RankLocal({"pos": 100 * rank + N})} as step N; report
      the digests of every global tensor of get_state_dict, and the bytes each rank's
      data files take.
  {"op": "restore", "kind": K, "store": DIR, "seed": S, "rank_local": "error"|"keep",
   "prepare": bool, "boom_on_rank": R, "boom_in": "_fill"|"_units"|"tensor"|"select"|"open",
   "via": "checkpointer"}
      build model K with other weights (seed S), restore into the same kind of state;
      report the digests, the restored step, the bytes read, the rank-local position and
      the torch RNG's next draw, or the error's type and message. "prepare": call
      snapcore.prepare first and report this rank's host slot files (name: inode) after
      it ("prepared") and after the restore ("slots"). "boom_on_rank": R makes
      Reader.<boom_in> (default "_fill") raise a RuntimeError on rank R ("open": opening
      the step, snapcore.api._reader, raises MemoryError() with no message). "via":
      "checkpointer": restore through Checkpointer.restore (the step it returns is
      "next_step").
  {"op": "kill-save", "kind": K, "store": DIR, "step": N, "victim": R, "point": P}
      save steps N then N + 1; rank R SIGKILLs itself during the second at point P
      ("staged": when async_save returns; "writing": once its data file exists; "part":
      once its part file exists; "index": once the step's index exists, for rank 0, the
      coordinator). The others report how the second save ended.
  {"op": "dcp-vs-snapcore", "dcp": DIR, "store": DIR}
      build an FSDP2 model (seed 0, two AdamW steps); save get_state_dict's {"model",
      "optim"} with torch.distributed.checkpoint into "dcp" and {"app": AppState} with
      snapcore into "store" (step 1); restore two fresh models (seed 1), one with dcp.load
      + set_state_dict, the other with snapcore.restore; report the digests of the saved
      state and of both restored ones, and what snapcore's restore opened in "dcp" or
      unpickled (see `no_pickle`).

  {"op": "early-verdict", "store": DIR}
      save step 1 with every data-file write held: whether the plan verdict became
      known while the writes were held (see `early_verdict`).

Run without torchrun too (the kill test starts plain processes with the env:// rendezvous
variables), so that a killed rank does not make an agent tear the others down.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import launch
import models
import torch
import torch.distributed as dist

import snapcore
from snapcore.distributed import AppState, RankLocal


def state_of(kind: str, seed: int, step: int, pad_mb: float = 0) -> tuple[dict[str, Any], Any, Any]:
    model, optim = models.build(kind, steps=2, seed=seed)
    rank = dist.get_rank()
    state = {
        "app": AppState(model, optim),
        "step": step,
        "rng": snapcore.RNGState(),
        "data": RankLocal({"pos": 100 * rank + step}),
    }
    if pad_mb:  # a rank-local tensor of that many MiB, its values from seed, rank, step
        gen = torch.Generator().manual_seed(1000 * seed + 10 * rank + max(step, 0))
        pad = torch.rand(int(pad_mb * (1 << 18)), generator=gen)
        state["pad"] = RankLocal(pad)
    return state, model, optim


def store_of(a: dict[str, Any]) -> Any:
    """A directory, or a dict of snapcore.Store's arguments (local, remote, ...); a value
    "$NAME" is the environment variable NAME (each node's own directory)."""
    spec = a["store"]
    if not isinstance(spec, dict):
        return spec
    kw = {k: _env(v) for k, v in spec.items()}
    if isinstance(kw.get("peer"), dict):
        kw["peer"] = snapcore.PeerSpec(**kw["peer"])
    return snapcore.Store(**kw)


def _env(v: Any) -> Any:
    return os.environ[v[1:]] if isinstance(v, str) and v.startswith("$") else v


def local_dir(a: dict[str, Any]) -> str | None:
    spec = a["store"]
    return _env(spec.get("local")) if isinstance(spec, dict) else spec


def digests(model: Any, optim: Any) -> dict[str, str]:
    sd = models.get_model_state(model, optim)
    return {k: models.digest(t) for k, t in models.global_tensors(sd).items()}


def _size(path: str) -> int:
    """A data file's size; 0 once gone (a re-save of a step collects the former save's
    files in the background)."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def save(a: dict[str, Any]) -> dict[str, Any]:
    if "max_groups" in a:  # fewer groups of ranks planned from their descriptions
        from snapcore.write import sharded

        sharded.MAX_GROUPS = a["max_groups"]
    state, model, optim = state_of(a["kind"], a.get("seed", 0), a["step"])
    torch.manual_seed(1234 + dist.get_rank())  # each rank's RNG state is its own
    snapcore.save(state, store_of(a), step=a["step"])
    rank, where = dist.get_rank(), local_dir(a)
    step_dir = os.path.join(where, f"step-{a['step']:012d}") if where else ""
    mine = glob.glob(os.path.join(step_dir, f"data-*-r{rank}.bin")) if where else []
    from snapcore.write.engine import engine_for

    sharder = engine_for(store_of(a)).sharder
    return {
        "digests": digests(model, optim),
        "rng_next": torch.rand(1).item(),
        "data_bytes": sum(_size(p) for p in mine),
        "exchange": sharder.exchange if sharder is not None else None,
        "exchange_why": sharder.exchange_why if sharder is not None else None,
    }


def load_alone(a: dict[str, Any]) -> dict[str, Any]:
    """Only rank 0 loads (an export under a process group): no collective, so no hang."""
    models.init_gloo()
    if dist.get_rank() == 0:
        tree = snapcore.load(store_of(a))
        return {"step": tree["step"]}
    return {}


def restore(a: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(99)
    state, model, optim = state_of(a["kind"], a.get("seed", 1), -1, a.get("pad_mb", 0))
    prepared = None
    if a.get("prepare"):  # a replaced node: fault in what its part is fetched into
        snapcore.prepare(state, store_of(a)).result()
        prepared = slot_inodes()
    with contextlib.ExitStack() as undo:
        if a.get("boom_on_rank") == dist.get_rank():  # not snapcore's error, mid-restore
            undo.enter_context(_boom_while_filling(a.get("boom_in", "_fill")))
        return _restore(a, state, model, optim, prepared)


@contextlib.contextmanager
def _boom_while_filling(where: str) -> Iterator[None]:
    """Reader.<where> raises RuntimeError: "_fill" (filling, after the exchanges),
    "_units" (listing what to share, before the plan exchange), "tensor" (reading a
    whole tensor, in a shared read too) or "select" (matching the state, before the
    plan exchange); "open": snapcore.api._reader (opening the step) raises MemoryError()."""
    from snapcore import api, read

    def boom(*args: Any, **kw: Any) -> None:
        raise RuntimeError("boom: out of memory while filling")

    def no_memory(*args: Any, **kw: Any) -> None:
        raise MemoryError()

    owner, name, fake = (
        (api, "_reader", no_memory) if where == "open" else (read.Reader, where, boom)
    )
    was = getattr(owner, name)
    setattr(owner, name, fake)
    try:
        yield
    finally:
        setattr(owner, name, was)


def _restore(a: dict[str, Any], state: Any, model: Any, optim: Any, prepared: Any) -> Any:
    if a.get("via") == "checkpointer":
        ckpt = snapcore.Checkpointer(store_of(a), max_interval_s=3600, handle_sigterm=False)
        try:
            next_step = ckpt.restore(state)
        except Exception as e:
            digests(model, optim)  # a collective: every rank must take part
            return {"error": type(e).__name__, "message": str(e)}
        finally:
            ckpt.close(final=False)
        return {"next_step": next_step, "digests": digests(model, optim)}
    try:
        info = snapcore.restore(
            state,
            store_of(a),
            step=a.get("at_by_rank", {}).get(str(dist.get_rank()), a.get("at")),
            rank_local=a.get("rank_local", "error"),
        )
    except Exception as e:  # snapcore's, gloo's RuntimeError, or the injected MemoryError
        digests(model, optim)  # a collective: every rank must take part
        return {"error": type(e).__name__, "message": str(e)}
    return {
        "digests": digests(model, optim),
        "step": info.step,
        "bytes": info.bytes,
        "tier": info.tier,
        "skipped": info.skipped,
        "tier_bytes": info.tier_bytes,
        "peer_bytes": info.peer_bytes,
        "peer_ranks": info.peer_ranks,
        "damaged": info.damaged,
        "pad": models.digest(state["pad"].value) if "pad" in state else None,
        "pos": state["data"].value["pos"],
        "saved_step": state["step"],
        "rng_next": torch.rand(1).item(),
        "prepared": prepared,
        "slots": slot_inodes() if prepared is not None else None,
    }


def slot_inodes() -> dict[str, int]:
    """This rank's slot files in its node's host area (SNAPCORE_TEST_SHM), by inode."""
    pattern = os.path.join(os.environ["SNAPCORE_TEST_SHM"], f"slot-r{dist.get_rank()}-*.bin")
    return {os.path.basename(f): os.stat(f).st_ino for f in glob.glob(pattern)}


def kill_save(a: dict[str, Any]) -> dict[str, Any]:
    store, step = a["store"], a["step"]
    state, model, optim = state_of(a["kind"], a.get("seed", 0), step)
    rank = dist.get_rank()
    snapcore.save(state, store, step=step)
    first = digests(model, optim)
    # the second step: other weights, so that a mixed snapshot cannot pass
    model(torch.randn(models.BATCH, models.D_IN)).pow(2).mean().backward()
    optim.step()
    second = digests(model, optim)
    state["step"] = step + 1
    launch.report({"first": first, "second": second, "phase": "saving"})
    victim = rank == a["victim"]
    if victim and a["point"] in ("writing", "part", "index"):
        pattern = {
            "writing": f"data-*-r{rank}.bin",
            "part": f"part-{rank:05d}-*",
            "index": "manifest.json",  # the coordinator has just committed
        }[a["point"]]
        where = os.path.join(store, f"step-{step + 1:012d}", pattern)

        def watch() -> None:
            while not glob.glob(where):
                time.sleep(0.0005)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()
    handle = snapcore.async_save(state, store, step=step + 1)
    if victim and a["point"] == "staged":
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        handle.wait()
        outcome: dict[str, Any] = {"ok": True}
    except snapcore.SnapcoreError as e:
        outcome = {"ok": False, "error": type(e).__name__, "message": str(e)}
    # the training goes on: this process keeps working without the dead rank
    outcome["after"] = float(torch.ones(3).sum())
    return {"first": first, "second": second, "outcome": outcome}


_watch: list[str] | None = None  # while set, what the audit hook saw
_hooked = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _watch is None:
        return
    if event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _watch.append(f"open {os.fsdecode(args[0])}")
    elif event == "pickle.find_class":
        _watch.append(f"unpickle {args[0]}.{args[1]}")


@contextlib.contextmanager
def no_pickle() -> Iterator[list[str]]:
    """Record every file opened and every unpickling done meanwhile: the audit hook sees
    each open and each global an Unpickler looks up; pickle.load/loads, pickle.Unpickler
    and torch.load are replaced by recorders too (an unpickling of plain containers
    looks up no global)."""
    global _watch, _hooked
    if not _hooked:  # once per process: an audit hook cannot be removed
        sys.addaudithook(_audit)
        _hooked = True
    seen: list[str] = []
    patched = {
        (pickle, "load"): pickle.load,
        (pickle, "loads"): pickle.loads,
        (pickle, "Unpickler"): pickle.Unpickler,
        (torch, "load"): torch.load,
    }

    def recorder(name: str, real: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            seen.append(f"unpickle via {name}")
            return real(*args, **kw)

        return call

    class Unpickler(pickle.Unpickler):  # a class: torch.load subclasses it
        def __init__(self, *args: Any, **kw: Any) -> None:
            seen.append("unpickle via pickle.Unpickler")
            super().__init__(*args, **kw)

    for (mod, name), real in patched.items():
        fake = Unpickler if name == "Unpickler" else recorder(f"{mod.__name__}.{name}", real)
        setattr(mod, name, fake)
    _watch = seen
    try:
        yield seen
    finally:
        _watch = None
        for (mod, name), real in patched.items():
            setattr(mod, name, real)


def dcp_vs_snapcore(a: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, optim = models.build("fsdp2", steps=2, seed=a.get("seed", 0))
    dcp.save(models.get_model_state(model, optim), checkpoint_id=a["dcp"])
    snapcore.save({"app": AppState(model, optim)}, a["store"], step=1)
    saved = digests(model, optim)

    dcp_model, dcp_optim = models.build("fsdp2", steps=2, seed=1)
    sd = models.get_model_state(dcp_model, dcp_optim)
    with no_pickle() as dcp_seen:  # the control: DCP's metadata is a pickle
        dcp.load(sd, checkpoint_id=a["dcp"])  # in place, into the DTensor shards
    set_state_dict(dcp_model, dcp_optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    sc_model, sc_optim = models.build("fsdp2", steps=2, seed=1)
    before = digests(sc_model, sc_optim)
    with no_pickle() as seen:
        info = snapcore.restore({"app": AppState(sc_model, sc_optim)}, a["store"])

    def split(seen: list[str]) -> dict[str, Any]:
        """The files opened, by directory ("dcp", "store"), and the unpicklings."""
        opened = [os.path.realpath(s[5:]) for s in seen if s.startswith("open ")]
        out: dict[str, Any] = {"unpickled": sorted({s for s in seen if not s.startswith("open ")})}
        for key in ("dcp", "store"):
            root = os.path.realpath(a[key]) + os.sep
            out[key] = sorted({os.path.relpath(p, root) for p in opened if p.startswith(root)})
        return out

    return {
        "saved": saved,
        "dcp": digests(dcp_model, dcp_optim),
        "snapcore": digests(sc_model, sc_optim),
        "before": before,
        "step": info.step,
        "dcp_load": split(dcp_seen),
        "snapcore_restore": split(seen),
    }


def replan(a: dict[str, Any]) -> dict[str, Any]:
    """Save step 1; add a tensor to the state on the ranks ``a["who"]`` names; save steps 2
    and 3 and report how each ended."""
    state, _, _ = state_of(a["kind"], a.get("seed", 0), 1)
    store = store_of(a)
    snapcore.save(state, store, step=1)
    if dist.get_rank() in a["who"]:
        state["extra"] = torch.arange(6.0)
    out = []
    from snapcore.write.engine import engine_for

    sharder = engine_for(store).sharder
    assert sharder is not None
    small = [sharder.small_exchange]  # the first save's exchange
    for step in (2, 3):
        state["step"] = step
        try:
            snapcore.save(state, store, step=step)
            out.append({"ok": True})
        except snapcore.SnapcoreError as e:
            out.append({"ok": False, "error": type(e).__name__, "message": str(e)})
    small.append(sharder.small_exchange)  # the re-plan's
    return {"saves": out, "small_exchange": small, "exchange": sharder.exchange}


def steady(a: dict[str, Any]) -> dict[str, Any]:
    """Save steps 1-4 of one state, changing it between saves as training would: AdamW
    steps (in place), a new generator state (RNGState builds new tensors at each call),
    the rank-local "extra" replaced by a new tensor of the same shape (step 2), then by
    one of another dtype (step 3: the part cannot be reused), kept (step 4); "overlap":
    save with overlap=True. Report per step the digests, "extra", a digest of the torch
    generator's state and how many saves reused the last part."""
    state, model, optim = state_of(a["kind"], a.get("seed", 0), 1)
    state["extra"] = RankLocal(torch.arange(6.0) + dist.get_rank())
    store = store_of(a)
    from snapcore.write.engine import engine_for

    data = torch.Generator().manual_seed(7 + dist.get_rank())
    out = []
    for step in (1, 2, 3, 4):
        if step > 1:
            model(torch.randn(models.BATCH, models.D_IN, generator=data)).pow(2).sum().backward()
            optim.step()
            optim.zero_grad()
            torch.rand(3)  # the generator moves on
        state["step"] = step
        if step == 2:
            state["extra"] = RankLocal(torch.arange(6.0) * 10 + dist.get_rank())
        elif step == 3:
            extra = torch.arange(6, dtype=torch.float64) * 100 + dist.get_rank()
            state["extra"] = RankLocal(extra)
        snapcore.async_save(state, store, step=step, overlap=bool(a.get("overlap"))).wait()
        sharder = engine_for(store).sharder
        assert sharder is not None
        out.append(
            {
                "digests": digests(model, optim),
                "extra": state["extra"].value.tolist(),
                "rng": models.digest(torch.get_rng_state()),
                "reused": sharder.reused,
            }
        )
    return {"steps": out}


def moved(a: dict[str, Any]) -> dict[str, Any]:
    """Save steps 1-4 of plain tensors: a global "buf" and a rank-local "extra", each
    replaced at step 2 by a new tensor alike (the part is reused, its blobs' sources
    moved), changed in place at step 3 (the same objects: reused again, from the new
    addresses, not the step-1 tensors' freed ones), kept at step 4. Reports per step
    the values saved and how many saves reused the last part."""
    from snapcore.write.engine import engine_for

    models.init_gloo()
    rank = dist.get_rank()
    state: dict[str, Any] = {
        "buf": torch.arange(64, dtype=torch.float32),
        "extra": RankLocal(torch.arange(64, dtype=torch.float32) + 1000 * rank),
    }
    store = store_of(a)
    out = []
    for step in (1, 2, 3, 4):
        if step == 2:
            state["buf"] = torch.arange(64, dtype=torch.float32) * 2
            state["extra"] = RankLocal(torch.arange(64, dtype=torch.float32) * 3 + rank)
        elif step == 3:
            state["buf"].add_(0.5)
            state["extra"].value.add_(0.25)
        state["step"] = step
        snapcore.async_save(state, store, step=step).wait()
        sharder = engine_for(store).sharder
        assert sharder is not None
        out.append(
            {
                "buf": state["buf"].tolist(),
                "extra": state["extra"].value.tolist(),
                "reused": sharder.reused,
            }
        )
    return {"steps": out}


def early_verdict(a: dict[str, Any]) -> dict[str, Any]:
    """Save step 1 with every data-file write held (until released): report whether the
    save's plan verdict became known while the writes were held (it must: the next
    save's plan reads it), the verdict, and whether the save had already finished then;
    then release the writes and report the saved values."""
    from snapcore import _native
    from snapcore.write.engine import engine_for

    models.init_gloo()
    rank = dist.get_rank()
    writing, release = threading.Event(), threading.Event()
    real = _native.FileWriter

    class Held:
        def __init__(self, path: str, *, direct: bool = True, truncate: bool = True) -> None:
            self._w = real(path, direct=direct, truncate=truncate)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._w, name)

        def write_at(self, offset: int, address: int, nbytes: int) -> None:
            writing.set()
            if not release.wait(60):
                raise RuntimeError("writes held for 60 s")
            self._w.write_at(offset, address, nbytes)

    _native.FileWriter = Held  # type: ignore[misc]
    try:
        state: dict[str, Any] = {
            "buf": torch.arange(1 << 18, dtype=torch.float32),
            "extra": RankLocal(torch.arange(1 << 18, dtype=torch.float32) + rank),
            "step": 1,
        }
        store = store_of(a)
        handle = snapcore.async_save(state, store, step=1)
        try:
            held = writing.wait(60)
            sharder = engine_for(store).sharder
            assert sharder is not None
            event, box = sharder.verdict_slot(sharder.seq)
            known = event.wait(30)
            done = handle.done()
        finally:
            release.set()
        handle.wait()
    finally:
        _native.FileWriter = real  # type: ignore[misc]
    return {"held": held, "known": known, "verdict": list(box), "done_then": done}


def checkpointer(a: dict[str, Any]) -> dict[str, Any]:
    """A training loop of ``a["steps"]`` steps (an all_reduce each, as training has) with
    a Checkpointer whose interval is bounded by ``a["max_interval_s"]``."""
    state, _, _ = state_of(a["kind"], a.get("seed", 0), 0)
    ckpt = snapcore.Checkpointer(
        store_of(a), max_interval_s=a["max_interval_s"], handle_sigterm=False, replan_s=0.05
    )
    seen = []
    for step in range(a["steps"]):
        t = torch.ones(1)
        dist.all_reduce(t)  # the ranks stay within a step of each other
        time.sleep(a.get("step_s", 0.02))
        state["step"] = step
        before = ckpt.stats().snapshots
        ckpt.step(step, state)
        if ckpt.stats().snapshots != before:
            seen.append(step)
    ckpt.close()
    return {"snapshot_steps": seen, "snapshots": ckpt.stats().snapshots}


def sigterm(a: dict[str, Any]) -> dict[str, Any]:
    """A training loop with a Checkpointer that handles SIGTERM; each rank sends itself a
    SIGTERM before its step ``a["term_at"][rank]``. Reports the last step it called."""
    state, _, _ = state_of(a["kind"], a.get("seed", 0), 0)
    ckpt = snapcore.Checkpointer(store_of(a), max_interval_s=3600, grace_s=60)
    rank = dist.get_rank()
    for step in range(a["steps"]):
        t = torch.ones(1)
        dist.all_reduce(t)
        state["step"] = step
        if step == a["term_at"][rank]:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the handler, nothing more
        launch.report([{"last_step": step}])
        ckpt.step(step, state)  # the final snapshot's step() ends the process
    ckpt.close()
    return {"last_step": a["steps"] - 1, "survived": True}


def ckpt_across(a: dict[str, Any]) -> dict[str, Any]:
    """A training loop of ``a["steps"]`` steps (an all_reduce each, ``step_s`` apart) with
    a Checkpointer (``max_interval_s``, ``lead``, ``grace_s``), and one thing going wrong:

    ``fail``: ``[R, N]``: rank R's local directory cannot begin its Nth step (ENOSPC);
    the loop catches the SnapshotFailed that follows, as the docs advise, and goes on.
    ``late``: ``[R, N, K]``: rank R hears rank 0's Nth decision K ``step()`` calls late.
    ``term_at``: each rank's step (or None) before whose ``step()`` it sends itself a
    SIGTERM. ``term_when_planned``: every rank sends itself a SIGTERM at the first step
    after 20 at which rank 0 has an ordinary snapshot published but not yet taken.

    Reports (before each ``step()``, which may end the process by the signal) the steps
    snapshotted, the step and time of the current call, and the errors raised."""
    from snapcore.directory import LocalDirectory
    from snapcore.scheduling import decisions as dmod

    state, _, _ = state_of(a["kind"], a.get("seed", 0), 0)
    rank = dist.get_rank()
    if a.get("fail") and a["fail"][0] == rank:
        real_begin, calls = LocalDirectory.begin, [0]

        def begin(self: Any, step: int) -> Any:
            calls[0] += 1
            if calls[0] == a["fail"][1]:
                print(f"rank {rank}: injected ENOSPC beginning step {step}", flush=True)
                raise OSError(28, "No space left on device (injected)")
            return real_begin(self, step)

        LocalDirectory.begin = begin  # type: ignore[method-assign]
    if a.get("late") and a["late"][0] == rank:
        real_next, held = dmod.Decisions.next, {"got": 0, "d": None, "calls": 0}

        def next_(self: Any) -> Any:
            if held["d"] is not None:
                held["calls"] += 1
                if held["calls"] <= a["late"][2]:
                    return None
                d, held["d"] = held["d"], None
                return d
            d = real_next(self)
            if d is not None:
                held["got"] += 1
                if held["got"] == a["late"][1]:
                    print(f"rank {rank}: holding the decision for step {d.step}", flush=True)
                    held["d"] = d
                    return None
            return d

        dmod.Decisions.next = next_  # type: ignore[method-assign]
    terms = a.get("term_at") or [None] * dist.get_world_size()
    ckpt = snapcore.Checkpointer(
        store_of(a),
        max_interval_s=a.get("max_interval_s", 3600),
        lead_steps=a.get("lead", 2),
        grace_s=a.get("grace_s", 30),
        replan_s=0.05,
        handle_sigterm=bool(a.get("term_at") or a.get("term_when_planned")),
    )
    seen: list[int] = []
    errors: list[Any] = []
    flagged = False
    for step in range(a["steps"]):
        t = torch.ones(1)
        if a.get("term_when_planned") and rank == 0 and step > 20 and not flagged:
            queue = ckpt._decisions._queue if ckpt._decisions is not None else []
            if any(not d.final for d in [*queue, *filter(None, [ckpt._planned])]):
                flagged = True
                t[0] = 100  # every rank learns it from this step's all_reduce
        try:
            dist.all_reduce(t)
        except RuntimeError:  # another rank ended (by its signal)
            return {"snapshot_steps": seen, "errors": errors, "peer_gone": [step, time.time()]}
        time.sleep(a.get("step_s", 0.02))
        state["step"] = step
        if step == terms[rank] or t.item() > 50:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the handler, nothing more
        before = ckpt.stats().snapshots
        launch.report([{"snapshot_steps": seen, "last_step": step, "at": time.time()}])
        try:
            ckpt.step(step, state)
        except snapcore.SnapcoreError as e:
            errors.append([step, type(e).__name__, str(e)[:300]])
        if ckpt.stats().snapshots != before:
            seen.append(step)
    ckpt.close()
    return {"snapshot_steps": seen, "errors": errors, "snapshots": ckpt.stats().snapshots}


def peer_save(a: dict[str, Any]) -> dict[str, Any]:
    """Save step N (with a rank-local pad of ``pad_mb`` MiB) and report each tier's
    outcome, the handle's warnings and the digests. With ``die_when`` (a glob, or a list of
    globs, "$NAME" expanded) and this rank in ``die_ranks``: SIGKILL this process as soon
    as a file matching each exists (the peer tier's receiving file of the step:
    mid-transfer), or ``die_delay_s`` seconds after. ``tiers``: the save's tiers (all of
    the store's by default). ``peer_s``: how long the peer tier took to resolve, from the
    return of ``async_save``."""
    step = a["step"]
    state, model, optim = state_of(a["kind"], a.get("seed", 0), step, a.get("pad_mb", 0))
    torch.manual_seed(1234 + dist.get_rank())
    store = store_of(a)
    saved = digests(model, optim)  # a collective: before any rank may die
    if a.get("die_when") and dist.get_rank() in a.get("die_ranks", []):
        when = a["die_when"] if isinstance(a["die_when"], list) else [a["die_when"]]
        patterns = [os.path.expandvars(w) for w in when]

        def watch() -> None:
            while not all(glob.glob(p) for p in patterns):
                time.sleep(0.0005)
            time.sleep(a.get("die_delay_s", 0))
            print(f"rank {dist.get_rank()}: SIGKILL mid-transfer ({patterns})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()
    try:
        handle = snapcore.async_save(state, store, step=step, tiers=a.get("tiers"))
    except ValueError as e:  # a store this job cannot save to (a peer tier on one node)
        return {"error": f"{type(e).__name__}: {e}"}
    t0 = time.monotonic()
    tiers: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for tier in handle.tiers:
        try:
            handle.wait(tier=tier)
            tiers[tier] = "ok"
        except (snapcore.SnapcoreError, ValueError) as e:  # ValueError: a tier left out
            tiers[tier] = f"{type(e).__name__}: {e}"
        seconds[tier] = time.monotonic() - t0
    return {
        "tiers": tiers,
        "peer_s": seconds.get("peer"),
        "warnings": handle.stats.warnings,
        "digests": saved,
        "pad": models.digest(state["pad"].value) if "pad" in state else None,
        "written": handle.stats.written,
    }


def die(a: dict[str, Any]) -> dict[str, Any]:
    """The ranks ``a["ranks"]`` SIGKILL themselves (a lost machine); the others go on."""
    snapcore.wait_all(store_of(a))
    if dist.get_rank() in a["ranks"]:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return {"survived": True}


def linger(a: dict[str, Any]) -> dict[str, Any]:
    """Stay alive (without a collective: a rank may be dead) until ``count`` ranks have
    come here, or ``max_s`` seconds, then ``after_s`` seconds more: a survivor's exit does
    not cut the others' rounds."""
    here = launch.workdir() / "linger"
    here.mkdir(exist_ok=True)
    (here / str(dist.get_rank())).touch()
    deadline = time.monotonic() + a.get("max_s", 60)
    while len(list(here.iterdir())) < a["count"] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(a.get("after_s", 0))  # then a while longer: what gloo does meanwhile
    return {"lingered": len(list(here.iterdir()))}


def fail_node_index(a: dict[str, Any]) -> dict[str, Any]:
    """On the ranks ``a["ranks"]``, writing a host-memory index of step ``a["step"]``
    fails (ENOSPC): a node leader's write of its node's index, after the coordinator's
    verdict committed the step."""
    from snapcore import directory

    if launch.rank() in a["ranks"]:  # (before the process group, made at the first save)
        real = directory.Pending.commit

        def commit(self: Any, *args: Any, **kw: Any) -> Any:
            if self.step == a["step"] and "/dev/shm/" in str(self.store.root):
                raise OSError(28, "No space left on device (injected)")
            return real(self, *args, **kw)

        directory.Pending.commit = commit  # type: ignore[method-assign]
    return {}


def no_host_verdict(a: dict[str, Any]) -> dict[str, Any]:
    """On the ranks ``a["ranks"]``, the coordinator's verdict on the host commit of step
    ``a["step"]`` does not come in time (as past the commit timeout: ``OutcomeUnknown``,
    the step committed on the other ranks); with ``"again": false``, nor when the peer
    thread asks for it once more."""
    from snapcore.write import commit

    if launch.rank() in a["ranks"]:
        real_part, real_get = commit.commit_part, commit.kv_get
        here = threading.local()

        def kv_get(job: Any, key: str, timeout_s: float) -> bytes | None:
            got = real_get(job, key, timeout_s)
            if getattr(here, "lose", False) and key.endswith("/host/verdict"):
                if not a.get("again", True):  # (rank 0's close need not wait for its ack)
                    job.kv.add(key[: -len("verdict")] + "ack", 1)
                return None  # it came, but too late
            return got

        def commit_part(
            job: Any, eid: int, spec: Any, tier: str, step: int, *r: Any, **k: Any
        ) -> Any:
            here.lose = tier == "host" and step == a["step"]
            try:
                return real_part(job, eid, spec, tier, step, *r, **k)
            finally:
                here.lose = False

        commit.kv_get = kv_get  # type: ignore[assignment]
        commit.commit_part = commit_part  # type: ignore[assignment]
        if not a.get("again", True):
            commit.read_verdict = lambda *args: None  # type: ignore[assignment]
    return {}


def unsupported(a: dict[str, Any]) -> dict[str, Any]:
    """Save step 1 with a Partial DTensor on rank ``a["bad_rank"]`` only (a state that
    rank cannot save), then step 2 without it; report how each save ended."""
    from torch.distributed.tensor import DTensor, Partial

    state, _, _ = state_of(a["kind"], a.get("seed", 0), 1)
    mesh = models.init_device_mesh("cpu", (dist.get_world_size(),))
    if dist.get_rank() == a["bad_rank"]:
        state["bad"] = DTensor.from_local(torch.ones(2), mesh, [Partial()], run_check=False)
    out = []
    for step in (1, 2):
        try:
            snapcore.save(state, store_of(a), step=step)
            out.append({"ok": True})
        except snapcore.SnapcoreError as e:
            out.append({"ok": False, "error": type(e).__name__, "message": str(e)})
        state.pop("bad", None)
    return {"saves": out}


def injected(a: dict[str, Any]) -> dict[str, Any]:
    """Save steps 1 to ``a["steps"]`` of a small state with a failure injected on rank
    ``a["rank"]`` at step ``a["at"]``, ``a["fail"]`` saying where: "local-write" (its
    local data write raises EIO, on the persist thread), "arena" (its arena cannot be
    made: MemoryError on the training thread, after the save took its number) or
    "host-part" (its part file in host memory: ENOSPC, on the hash thread); with
    "local-write", ``a["fail_after"]`` seconds pass before it raises, and with
    ``a["slow"]`` the other ranks' local writes of that step take that many seconds
    more (they learn of the failure later). With
    ``a["settle"]``, that rank waits for the failed save's outcome before its next
    call; the other ranks call at once. With ``a["retry"]``, a call that raised
    ``SnapshotFailed`` is made again (an earlier failure, now told: as
    ``Checkpointer.close`` does). With ``a["wait_each"]``, each save's tiers are
    waited for before the next call, else after the last. Reports per step how the call
    ended ("handed", or the error), each tier's outcome ("ok" or the error) with the
    seconds from the call, and what ``snapcore.wait_all`` raised at the end."""
    import errno

    from snapcore import directory
    from snapcore.write import engine as write_engine
    from snapcore.write import job as write_job

    models.init_gloo()
    rank = dist.get_rank()
    mine = rank == a["rank"]
    fail, at = a["fail"], a["at"]
    if mine and fail == "local-write":
        real_write = write_job.LocalWriter.write

        def write(self: Any, *args: Any, **kw: Any) -> Any:
            if self.s.step == at:
                time.sleep(a.get("fail_after", 0))  # (its host part announced meanwhile)
                raise OSError(errno.EIO, "Input/output error (injected)")
            return real_write(self, *args, **kw)

        write_job.LocalWriter.write = write  # type: ignore[method-assign]
    elif fail == "local-write" and a.get("slow"):  # the others learn of it later
        real_slow = write_job.LocalWriter.write

        def slow(self: Any, *args: Any, **kw: Any) -> Any:
            if self.s.step == at:
                time.sleep(a["slow"])
            return real_slow(self, *args, **kw)

        write_job.LocalWriter.write = slow  # type: ignore[method-assign]
    elif mine and fail == "arena":
        real_arena = write_engine.Engine._arena
        steps = iter(range(1, a["steps"] + 1))

        def arena(self: Any, *args: Any, **kw: Any) -> Any:
            if next(steps) == at:
                raise MemoryError("cannot allocate the arena (injected)")
            return real_arena(self, *args, **kw)

        write_engine.Engine._arena = arena  # type: ignore[method-assign]
    elif mine and fail == "host-part":
        real_part = directory.Pending.write_part

        def write_part(self: Any, r: int, data: bytes) -> Any:
            if self.step == at and str(self.dir).startswith("/dev/shm"):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real_part(self, r, data)

        directory.Pending.write_part = write_part  # type: ignore[method-assign]
    store = store_of(a)
    state: dict[str, Any] = {"own": RankLocal(torch.full((4096,), float(rank))), "step": 0}
    calls: list[str] = []
    handles: list[tuple[Any, float]] = []
    tiers: list[dict[str, Any] | None] = []

    for step in range(1, a["steps"] + 1):
        state["step"] = step
        if mine and a.get("settle") and step == at + 1 and handles[-1][0] is not None:
            handles[-1][0].settle()  # its failure is known before its next call
        t0 = time.monotonic()
        try:
            h = snapcore.async_save(state, store, step=step)
            calls.append("handed")
        except (snapcore.SnapcoreError, MemoryError) as e:
            h = None
            calls.append(f"{type(e).__name__}: {e}")
            if a.get("retry") and isinstance(e, snapcore.SnapshotFailed):
                h = snapcore.async_save(state, store, step=step)  # as Checkpointer.close
                calls[-1] += " | again: handed"
        handles.append((h, t0))
        if a.get("wait_each"):
            tiers.append(_tier_outcomes(h, t0) if h is not None else None)
    if not a.get("wait_each"):
        tiers = [_tier_outcomes(h, t0) if h is not None else None for h, t0 in handles]
    try:
        snapcore.wait_all(store)
        end = "ok"
    except snapcore.SnapcoreError as e:
        end = f"{type(e).__name__}: {e}"
    return {"calls": calls, "tiers": tiers, "end": end}


def _tier_outcomes(h: Any, t0: float) -> dict[str, list[Any]]:
    """Each tier of handle ``h``: "ok" or its error, and when it ended (since ``t0``)."""
    out: dict[str, list[Any]] = {}
    for tier in h.tiers:
        try:
            h.wait(tier=tier)
            out[tier] = ["ok", time.monotonic() - t0]
        except snapcore.SnapcoreError as e:
            out[tier] = [f"{type(e).__name__}: {e}", time.monotonic() - t0]
    return out


def early(a: dict[str, Any]) -> dict[str, Any]:
    """Save steps 1 to ``a["steps"]`` of a small state, rank ``a["rank"]`` failing before
    its save of step ``a["at"]`` takes its number, ``a["fail"]`` saying how: "lock" (a
    second writer holds its node's writer lock: a lock this process takes on the store's
    ``writer.lock`` through a file of its own, let go after that save; the rank must be
    its node's LOCAL_RANK 0), "walk" (its state holds a value snapcore refuses, at that
    save only), "link" (the peer tier's link cannot be made on it once the link's
    collective is done) or "home" (its peer settings cannot be read, before the link's
    collective). After each save (and its tiers' outcome) every rank meets the others in
    a barrier on the training's group, as training's next collective would. Reports per
    step how the call ended and each tier's outcome, each with its seconds from the call."""
    import fcntl
    import socket

    from snapcore import settings
    from snapcore.write import engine as write_engine

    models.init_gloo()
    rank = dist.get_rank()
    mine = rank == a["rank"]
    fail, at = a["fail"], a["at"]
    store = store_of(a)
    held: list[int] = []
    if mine and fail == "lock":
        root = local_dir(a)
        assert root is not None
        os.makedirs(root, exist_ok=True)
        fd = os.open(os.path.join(root, "writer.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        who = {"pid": 4242, "host": socket.gethostname(), "since": time.time()}
        os.pwrite(fd, json.dumps(who).encode(), 0)
        held.append(fd)
    elif mine and fail == "link":
        real_open, once = write_engine.open_link, [True]

        def open_link(*args: Any, **kw: Any) -> Any:
            link = real_open(*args, **kw)  # the collective: every rank made it
            if once:
                once.clear()
                link.close()
                raise RuntimeError("cannot start the peer thread (injected)")
            return link

        write_engine.open_link = open_link  # type: ignore[assignment]
    elif mine and fail == "home":
        real_domain, tries = settings.failure_domain, [0]

        def failure_domain() -> str | None:
            tries[0] += 1
            if tries[0] == 1:
                raise ValueError("SNAPCORE_FAILURE_DOMAIN cannot be read (injected)")
            return real_domain()

        settings.failure_domain = failure_domain  # type: ignore[assignment]
    state: dict[str, Any] = {"own": RankLocal(torch.full((4096,), float(rank))), "step": 0}
    calls: list[list[Any]] = []
    tiers: list[dict[str, list[Any]] | None] = []
    for step in range(1, a["steps"] + 1):
        state["step"] = step
        if mine and fail == "walk" and step == at:
            state["bad"] = object()
        t0 = time.monotonic()
        try:
            h = snapcore.async_save(state, store, step=step)
            calls.append(["handed", time.monotonic() - t0])
        except Exception as e:
            h = None
            calls.append([f"{type(e).__name__}: {e}", time.monotonic() - t0])
        state.pop("bad", None)
        tiers.append(_tier_outcomes(h, t0) if h is not None else None)
        launch.report([{"calls": calls, "tiers": tiers}])
        dist.barrier()  # training's next collective: every rank must come
        if step == at:
            for fd in held:  # the second writer is gone
                os.close(fd)
            held.clear()
    return {"calls": calls, "tiers": tiers}


OPS = {
    "early": early,
    "injected": injected,
    "die": die,
    "linger": linger,
    "fail-node-index": fail_node_index,
    "no-host-verdict": no_host_verdict,
    "unsupported": unsupported,
    "peer-save": peer_save,
    "load-alone": load_alone,
    "sigterm": sigterm,
    "save": save,
    "restore": restore,
    "kill-save": kill_save,
    "replan": replan,
    "steady": steady,
    "moved": moved,
    "early-verdict": early_verdict,
    "checkpointer": checkpointer,
    "ckpt-across": ckpt_across,
    "dcp-vs-snapcore": dcp_vs_snapcore,
}


def main(actions: list[dict[str, Any]]) -> None:
    out = []
    for a in actions:
        out.append(OPS[a["op"]](a))
        launch.report(out)
    snapcore.close()  # every snapshot waited for, its failures raised here
    if not any(
        a["op"] in ("kill-save", "sigterm", "ckpt-across") or a.get("no_barrier") for a in actions
    ):
        models.shutdown()  # (else the dead rank cannot join a barrier: leave without one)
    # Nothing of snapcore's is left to run: skip the interpreter's teardown, where gloo's
    # threads sometimes abort a process (models.py, quirks).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
