"""One round of copies between ranks over snapcore's peer group: torch.distributed's
point-to-point ``isend``/``irecv`` on a gloo group of its own, no protocol of our own
below that. Every rank of a round posts its sends and its receives of each stage, then
waits for all of them, so that a ring (each rank both sends and receives) cannot
deadlock:

1. a header per copy (int64: magic, status, description length, data length);
2. the description: the step's index, the part (their bytes), as JSON;
3. the receiver's answer: accepted, or refused with its reason (memory full, a copy of
   the wrong step, a part that does not match its index);
4. the data files the part names, in pieces of ``piece_bytes``, paced to ``rate`` bytes
   per second when one is set (the sender sleeps between pieces);
5. the receiver's verdict once every chunk's XXH3-128 matched and the copy is
   committed (or why not).

A rank that dies mid-round makes the ranks talking to it fail at once (gloo reports the
reset connection) or after the group's timeout; that is ``PeerLinkError``.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _native
from ..errors import SnapcoreError
from .area import Copy, Destination

__all__ = ["Incoming", "Outgoing", "PeerLinkError", "exchange"]

MAGIC = 0x5C9EE4
REPLY_BYTES = 1024


# The stages' times of this process's last round, in seconds (what benchmarks/bench_peer.py
# reports: where a transfer's time goes).
last_round: dict[str, float] = {}


class PeerLinkError(SnapcoreError):
    """The transport failed mid-round (a partner died, or did not answer in time)."""


@dataclass
class Outgoing:
    """A copy this rank sends to ``dst``: ``copy`` and its data files (``paths``, in the
    part's order), or ``error``: why it has none (told to the receiver)."""

    dst: int
    copy: Copy | None
    paths: list[Path]
    error: str | None = None


@dataclass
class Incoming:
    """A copy this rank receives from ``src`` into ``dest``."""

    src: int
    dest: Destination


@dataclass
class Pacer:
    """Sleeps so that the bytes sent stay under ``rate`` per second (None: no limit)."""

    rate: float | None
    sent: int = 0
    t0: float = 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def account(self, nbytes: int) -> None:
        if self.rate is None or nbytes == 0:
            return
        self.sent += nbytes
        ahead = self.sent / self.rate - (time.perf_counter() - self.t0)
        if ahead > 0:
            time.sleep(ahead)


def exchange(
    group: Any,
    outgoing: list[Outgoing],
    incoming: list[Incoming],
    *,
    piece_bytes: int,
    rate: float | None = None,
) -> tuple[dict[int, str | None], dict[int, str | None]]:
    """Run one round; returns, per destination and per source, None when the copy was
    committed there, else why not. Raises ``PeerLinkError`` when the transport fails
    (every copy of the round is then lost; nothing half-received is committed)."""
    import torch.distributed as dist

    sent: dict[int, str | None] = {o.dst: None for o in outgoing}
    got: dict[int, str | None] = {i.src: None for i in incoming}
    peers = sorted({o.dst for o in outgoing} | {i.src for i in incoming})
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        # 1. headers, 2. descriptions
        metas: dict[int, bytes] = {}
        heads_out = []
        for o in outgoing:
            meta, status, data = _describe(o)
            metas[o.dst] = meta
            heads_out.append((o.dst, torch.tensor([MAGIC, status, len(meta), data])))
        heads_in = {i.src: torch.zeros(4, dtype=torch.int64) for i in incoming}
        _run(
            [dist.isend(t, d, group=group) for d, t in heads_out]
            + [dist.irecv(t, s, group=group) for s, t in heads_in.items()]
        )
        for s, h in heads_in.items():
            if int(h[0]) != MAGIC:
                raise PeerLinkError(f"rank {s} sent no peer-copy header (protocol mismatch)")
        bufs_in = {s: torch.empty(int(h[2]), dtype=torch.uint8) for s, h in heads_in.items()}
        _run(
            [dist.isend(_bytes(metas[o.dst]), o.dst, group=group) for o in outgoing if metas[o.dst]]
            + [dist.irecv(b, s, group=group) for s, b in bufs_in.items() if b.numel()]
        )
        times["describe"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # 3. the receivers' answers
        accepted_in: list[Incoming] = []
        answers_out: list[tuple[int, torch.Tensor]] = []
        for i in incoming:
            meta = bytes(bufs_in[i.src].numpy())
            why: str | None
            if int(heads_in[i.src][1]) != 0:
                why = f"rank {i.src} had no copy to send: {meta.decode(errors='replace')}"
            else:
                try:
                    i.dest.prepare(meta)
                    why = None
                except (SnapcoreError, OSError, ValueError) as e:
                    why = f"{type(e).__name__}: {e}"
            got[i.src] = why
            if why is None:
                accepted_in.append(i)
            answers_out.append((i.src, _reply(why)))
        answers_in = {o.dst: torch.zeros(REPLY_BYTES, dtype=torch.uint8) for o in outgoing}
        _run(
            [dist.isend(t, s, group=group) for s, t in answers_out]
            + [dist.irecv(t, d, group=group) for d, t in answers_in.items()]
        )
        accepted_out: list[Outgoing] = []
        for o in outgoing:
            why = o.error or _why(answers_in[o.dst])
            sent[o.dst] = why
            if why is None:
                accepted_out.append(o)
        times["prepare"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # 4. the data, piece by piece, through two buffers per copy: a piece is read
        # from its file (sender) or written to it (receiver) while the next one travels
        _data(group, accepted_out, accepted_in, piece_bytes, Pacer(rate))
        times["data"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # 5. the receivers' verdicts
        verdicts_out = []
        for i in accepted_in:
            try:
                i.dest.finish()
                why = None
            except (SnapcoreError, OSError, ValueError) as e:
                why = f"{type(e).__name__}: {e}"
            got[i.src] = why
            verdicts_out.append((i.src, _reply(why)))
        verdicts_in = {o.dst: torch.zeros(REPLY_BYTES, dtype=torch.uint8) for o in accepted_out}
        _run(
            [dist.isend(t, s, group=group) for s, t in verdicts_out]
            + [dist.irecv(t, d, group=group) for d, t in verdicts_in.items()]
        )
        for d, t in verdicts_in.items():
            sent[d] = _why(t)
        times["check_commit"] = time.perf_counter() - t0
        last_round.clear()
        last_round.update(times)
    except PeerLinkError:
        _abort(incoming)
        raise
    except Exception as e:  # gloo: a reset connection, a timeout
        _abort(incoming)
        raise PeerLinkError(
            f"the peer transfer with ranks {peers} failed: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else e}"
        ) from e
    return sent, got


def _describe(o: Outgoing) -> tuple[bytes, int, int]:
    """(description, status, data length) of an outgoing copy; status 1: none to send."""
    if o.copy is None:
        return (o.error or "no copy").encode()[:65536], 1, 0
    try:
        for path, (name, size) in zip(o.paths, o.copy.files, strict=True):
            got = os.stat(path).st_size
            if got < size:
                raise SnapcoreError(f"{path} has {got} bytes, the part says {size} ({name})")
    except (OSError, SnapcoreError) as e:
        o.error = f"{type(e).__name__}: {e}"
        o.copy = None
        return o.error.encode()[:65536], 1, 0
    return o.copy.meta(), 0, sum(n for _, n in o.copy.files)


def _data(group: Any, out: list[Outgoing], inc: list[Incoming], piece: int, pacer: Pacer) -> None:
    import torch.distributed as dist

    sends = {o.dst: _cut(o.copy.files if o.copy else [], piece) for o in out}
    recvs = {i.src: _cut(i.dest.copy.files if i.dest.copy else [], piece) for i in inc}
    paths = {o.dst: o.paths for o in out}
    dests = {i.src: i.dest for i in inc}
    sbuf = {d: _buffers(p, piece) for d, p in sends.items()}
    # A receiver's pieces go straight into its destination's mapping (faulted in ahead
    # of them); only a copy that has failed on the way takes a buffer, to drop them into.
    spare: dict[int, torch.Tensor] = {}
    landed: dict[tuple[int, int], bool] = {}  # (source, piece): it went into the mapping

    def load(d: int, k: int) -> None:  # sender: piece k of its files into a buffer
        f, off, n = sends[d][k]
        _native.read_into(str(paths[d][f]), off, n, sbuf[d][k % 2].data_ptr())

    def into(s: int, k: int) -> torch.Tensor:  # receiver: where piece k lands
        f, off, n = recvs[s][k]
        t = dests[s].target(f, off, n)
        landed[s, k] = t is not None
        if t is None:
            if s not in spare:
                spare[s] = torch.empty(max(p[2] for p in recvs[s]), dtype=torch.uint8)
            t = spare[s][:n]
        return t

    def store(s: int, k: int) -> None:  # receiver: piece k has arrived; hash it
        f, off, n = recvs[s][k]
        if landed.pop((s, k)):
            dests[s].received(f, off, n)

    for d, p in sends.items():
        if p:
            load(d, 0)
    pacer.start()
    rounds = max([len(p) for p in (*sends.values(), *recvs.values())], default=0)
    for k in range(rounds):
        works = [
            dist.isend(sbuf[d][k % 2][: p[k][2]], d, group=group)
            for d, p in sends.items()
            if k < len(p)
        ]
        works += [dist.irecv(into(s, k), s, group=group) for s, p in recvs.items() if k < len(p)]
        for s, p in recvs.items():  # the piece before (arrived), while this one travels
            if 0 < k <= len(p):
                store(s, k - 1)
        for d, p in sends.items():  # the piece after, likewise
            if k + 1 < len(p):
                load(d, k + 1)
        _run(works)
        pacer.account(sum(p[k][2] for p in sends.values() if k < len(p)))
    for s, p in recvs.items():
        if p and len(p) >= rounds:
            store(s, len(p) - 1)


def _cut(files: list[tuple[str, int]], piece: int) -> list[tuple[int, int, int]]:
    """The pieces of a copy's files: (file, offset, length), in order."""
    return [
        (f, off, min(piece, size - off))
        for f, (_, size) in enumerate(files)
        for off in range(0, size, piece)
    ]


def _buffers(pieces: list[tuple[int, int, int]], piece: int) -> list[torch.Tensor]:
    n = max([p[2] for p in pieces], default=0)
    return [torch.empty(n, dtype=torch.uint8) for _ in range(2)] if n else []


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _reply(why: str | None) -> torch.Tensor:
    t = torch.zeros(REPLY_BYTES, dtype=torch.uint8)
    if why is None:
        t[0] = 1
        return t
    text = why.encode()[: REPLY_BYTES - 3]
    t[0] = 2
    t[1] = len(text) >> 8
    t[2] = len(text) & 0xFF
    t[3 : 3 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return t


def _why(t: torch.Tensor) -> str | None:
    if int(t[0]) == 1:
        return None
    n = (int(t[1]) << 8) | int(t[2])
    return bytes(t[3 : 3 + n].numpy()).decode(errors="replace") or "refused"


def _run(works: list[Any]) -> None:
    first: BaseException | None = None
    for w in works:
        try:
            w.wait()
        except BaseException as e:  # wait for the others too: their buffers are in use
            first = first or e
    if first is not None:
        raise first


def _abort(incoming: list[Incoming]) -> None:
    for i in incoming:
        with contextlib.suppress(Exception):
            i.dest.abort()
