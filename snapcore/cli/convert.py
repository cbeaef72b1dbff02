"""``snapcore convert SRC DST``: a checkpoint into another format, tensor by tensor."""

from __future__ import annotations

import argparse

from ..convert import FORMATS, convert
from ..convert.run import DTYPES, GB, detect, parse_size
from .output import add_progress_args, clean, human_bytes, progress, progress_enabled
from .stores import UsageError, storage_options, store_from


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "convert", help="convert a checkpoint (snapcore, safetensors...) into another format"
    )
    p.add_argument("src", metavar="SRC", help="the checkpoint to read (a store, file or directory)")
    p.add_argument("dst", metavar="DST", help="the new checkpoint (must not exist, or be empty)")
    p.add_argument("--to", metavar="FORMAT", help=f"the target's format ({', '.join(FORMATS)})")
    p.add_argument("--from", dest="from_", metavar="FORMAT", help="default: detected")
    p.add_argument("--step", type=int, help="snapcore: the step read (newest) and written (0)")
    p.add_argument("--only", metavar="GLOB", action="append", default=[], help="keep these names")
    p.add_argument("--strip-prefix", metavar="P", help="remove this prefix from the names")
    p.add_argument(
        "--rename", metavar="REGEX=REPL", action="append", default=[], help="re.sub on names"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating tensors")
    p.add_argument("--shard-size", metavar="SIZE", default="5GB", help="safetensors: per file")
    p.add_argument("--remote", metavar="URL", help="snapcore source: its object-storage tier")
    p.add_argument("--host", metavar="NAME", help="snapcore source: its host-memory tier")
    p.add_argument(
        "--storage-options", metavar="JSON", help="fsspec options of SRC and DST URLs (JSON)"
    )
    p.add_argument(
        "--tmp-dir",
        metavar="DIR",
        help="snapcore URL DST: where the step is written before its upload (default: TMPDIR)",
    )
    add_progress_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.to is None:
        raise UsageError(f"give --to FORMAT ({', '.join(FORMATS)})")
    for name, what in ((args.to, "--to"), (args.from_, "--from")):
        if name is not None and name not in FORMATS:
            raise UsageError(f"{what} {name}: formats are {', '.join(FORMATS)}")
    rename = []
    for r in args.rename:
        regex, eq, repl = r.partition("=")
        if not eq or not regex:
            raise UsageError(f"--rename {r}: give REGEX=REPL")
        rename.append((regex, repl))
    try:
        shard_size = parse_size(args.shard_size)
    except ValueError as e:
        raise UsageError(f"--shard-size: {e}") from None
    source_format = args.from_ or detect(args.src)
    options: dict[str, object] = {}
    if source_format == "snapcore":
        args.store = args.src
        store = store_from(args)
        options["store"] = store
        options["storage_options"] = store.storage_options
    elif args.host or args.remote:
        raise UsageError("--host and --remote name tiers of a snapcore source")
    else:
        options["storage_options"] = storage_options(args)
    if args.tmp_dir is not None:
        options["tmp_dir"] = args.tmp_dir
    with progress(None, f"convert to {args.to}", progress_enabled(args)) as advance:
        done_so_far = [0]

        def report(done: int, total: int) -> None:  # the driver counts from the start
            advance(done - done_so_far[0], total=total)
            done_so_far[0] = done

        stats = convert(
            args.src,
            args.dst,
            to=args.to,
            from_=source_format,
            step=args.step,
            only=args.only,
            strip_prefix=args.strip_prefix,
            rename=rename,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            shard_size=shard_size or 5 * GB,
            progress=report,
            **options,
        )
    alias = f" ({stats.aliases} tied, written once)" if stats.aliases else ""
    print(
        clean(
            f"{args.dst}: {stats.tensors} tensors{alias}, {human_bytes(stats.bytes)}, "
            f"{stats.values} values, from {stats.source_format} in {stats.seconds:.2f} s"
        )
    )
    for s in stats.skipped:
        print(clean(f"skipped (no place in {args.to}): {s}"))
    return 0
