"""Parsing and dispatch; every error a user can cause becomes one line and an exit code."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import CorruptSnapshot, SnapcoreError
from . import cat, convert, diff, gc, hosts, inspect, journal, ls, verify
from .output import clean
from .stores import UsageError

USAGE_ERROR = 2  # argparse's own code for bad arguments
# A verb whose exit 1 means an answer (diff: the snapshots differ) fails with 2, as
# diff(1) and cmp(1) do.
FAILED = {"diff": 2}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="snapcore", description="Inspect and manage snapcore stores.")
    p.add_argument("--version", action="version", version=f"snapcore {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    for verb in (ls, inspect, cat, diff, verify, gc, journal, hosts, convert):
        verb.add_parser(sub)
    sub.add_parser("plan", help="what-if for the checkpoint interval (see snapcore plan -h)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns its exit code (docs/cli.md): 0 done, 1 failed (a damaged
    snapshot, a missing store, an I/O error), 2 bad arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _run(argv)
        sys.stdout.flush()
    except KeyboardInterrupt:
        # Ctrl-C: what a verb was writing is aborted by the verb itself (convert removes
        # its temporary target); one line, the shell's code for SIGINT, no traceback.
        print("snapcore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`snapcore ls | head`): stop quietly. Python would report
        # the failed flush of stdout at exit, so stdout now goes to /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return code


def _run(argv: list[str]) -> int:
    if argv[:1] == ["plan"]:
        from ..scheduling.plan import plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        raise
    except UsageError as e:
        print(clean(f"snapcore {args.cmd}: {e}"), file=sys.stderr)
        return USAGE_ERROR
    except CorruptSnapshot as e:
        print(clean(f"snapcore {args.cmd}: damaged: {e}"), file=sys.stderr)
    except (SnapcoreError, OSError, ValueError) as e:
        print(clean(f"snapcore {args.cmd}: {_message(e)}"), file=sys.stderr)
    return FAILED.get(args.cmd, 1)


def _message(e: BaseException) -> str:
    if isinstance(e, OSError) and not isinstance(e, SnapcoreError) and e.strerror:
        where = f": {e.filename}" if e.filename else ""
        return f"{e.strerror}{where}"
    return str(e)
