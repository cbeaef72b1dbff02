"""The store arguments every verb takes, and opening a store's tiers read-only."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .. import manifest as mf
from ..errors import SnapcoreError, SnapshotNotFound
from ..read import Reader
from ..tiers import HostTier, Store, Tier, as_store, open_tiers


class UsageError(ValueError):
    """Arguments that do not name what the verb needs (exit 2, like argparse's own)."""


def add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "store",
        nargs="?",
        help="a local directory, or an fsspec URL (s3://bucket/prefix); may be left out "
        "for a store of --host and/or --remote tiers only",
    )
    p.add_argument("--remote", metavar="URL", help="the object-storage tier of this store")
    p.add_argument("--host", metavar="NAME", help="the host-memory tier (/dev/shm/snapcore-NAME)")
    p.add_argument(
        "--storage-options", metavar="JSON", help="fsspec options, e.g. '{\"anon\": true}'"
    )


def storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--storage-options``, parsed (None when not given)."""
    if not args.storage_options:
        return None
    try:
        options = json.loads(args.storage_options)
    except ValueError as e:
        raise ValueError(f"--storage-options is not JSON: {e}") from None
    if not isinstance(options, dict):
        raise ValueError("--storage-options must be a JSON object")
    return options


def store_from(args: argparse.Namespace, **extra: Any) -> Store:
    """The Store the arguments describe: STORE is a directory or a URL."""
    options = storage_options(args)
    local, remote = None, None
    if args.store is not None:
        base = as_store(args.store)
        local, remote = base.local, base.remote
    elif args.host is None and args.remote is None:
        raise UsageError("give a STORE (a directory or URL), --remote URL or --host NAME")
    if remote is not None and args.remote is not None:
        raise ValueError("STORE is a URL already: --remote is for a local STORE")
    return Store(
        local=local,
        remote=args.remote or remote,
        host=args.host,
        storage_options=options,
        **extra,
    )


@dataclass
class OpenStore:
    """A store's tiers, open for reading, fastest first."""

    store: Store
    tiers: dict[str, Tier]

    def committed(self) -> dict[str, list[int]]:
        return {name: t.committed_steps() for name, t in self.tiers.items()}

    def resolve(self, step: int | None) -> tuple[int, list[str]]:
        """``step`` (default: the newest committed anywhere) and the tiers holding it."""
        steps = self.committed()
        every = sorted({s for ss in steps.values() for s in ss})
        if not every:
            raise SnapshotNotFound(f"no committed snapshot in {self.store.describe()}")
        if step is None:
            step = every[-1]
        holders = [name for name, ss in steps.items() if step in ss]
        if not holders:
            raise SnapshotNotFound(
                f"no committed snapshot of step {step} in {self.store.describe()}"
            )
        return step, holders

    def manifest(self, step: int, tier: str | None = None) -> tuple[str, mf.Manifest]:
        """The manifest of ``step`` from ``tier``, or from the fastest tier that reads."""
        step, holders = self.resolve(step)
        if tier is not None:
            if tier not in holders:
                raise SnapshotNotFound(f"step {step} is not committed in the {tier} tier")
            holders = [tier]
        first: SnapcoreError | None = None
        for name in holders:
            try:
                return name, self.tiers[name].read_manifest(step)
            except SnapcoreError as e:
                first = first or e
        assert first is not None
        raise first

    def reader(self, step: int | None, tier: str | None = None) -> Reader:
        """A verifying reader of ``step`` (default: the newest) over every tier holding
        it, fastest first (or ``tier``'s copy only), as ``snapcore.load`` reads."""
        step, holders = self.resolve(step)
        if tier is not None:
            if tier not in holders:
                raise SnapshotNotFound(f"step {step} is not committed in the {tier} tier")
            holders = [tier]
        sources = []
        damaged: list[str] = []
        first: SnapcoreError | None = None
        for name in holders:
            try:
                sources.append((self.tiers[name], self.tiers[name].read_manifest(step)))
            except SnapcoreError as e:
                damaged.append(f"{name}: {e}")
                first = first or e
        if not sources:
            assert first is not None
            raise first
        reader = Reader(sources, verify=True)
        reader.damaged.extend(damaged)
        return reader


@contextlib.contextmanager
def open_store(args: argparse.Namespace, **extra: Any) -> Iterator[OpenStore]:
    """Open the store of the arguments for reading; a store that does not exist (a
    missing directory, a path to a file, an empty prefix, an unknown host area) is
    ``SnapshotNotFound``, so that every verb exits non-zero on it."""
    store = store_from(args, **extra)
    tiers = open_tiers(store)
    try:
        check_exists(store, tiers)
        yield OpenStore(store, tiers)
    finally:
        for t in tiers.values():
            close = getattr(t, "close", None)
            if close is not None:
                close()


def check_exists(store: Store, tiers: dict[str, Tier] | None = None) -> None:
    """Raise ``SnapshotNotFound`` for a store that does not exist; its object storage is
    looked at only when the store has no local directory and ``tiers`` are given."""
    if store.local is not None:
        path = os.fspath(store.local)
        if not os.path.exists(path):
            raise SnapshotNotFound(f"no store at {path}: no such directory")
        if not os.path.isdir(path):
            raise SnapshotNotFound(f"no store at {path}: not a directory")
    if store.host is not None:
        area = HostTier(store.host)
        if not area.root.is_dir():
            raise SnapshotNotFound(f"no host-memory area {store.host!r} ({area.root})")
    if store.local is None and store.remote is not None and tiers is not None:
        remote = tiers["remote"]
        if not remote.rt.list(""):  # type: ignore[union-attr]
            raise SnapshotNotFound(f"no store at {store.remote}: nothing under that prefix")
