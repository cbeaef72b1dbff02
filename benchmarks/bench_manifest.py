"""How long, and how much memory, parsing the largest manifest the format allows takes.

A manifest is at most 64 MiB (docs/format.md); the one built here fills that cap with
as many tensors as fit (small views into one blob, a dict tree of short names: the most
JSON objects the cap allows). Each run parses it in a fresh process and reports
the wall time of each phase (UTF-8 + JSON, schema, building and checking the Manifest)
and the process's peak RSS over what the interpreter and imports already held. The
phases are JSON decoding as parse() does it (with its duplicate-key hook) and the whole
compiled schema on its own (parse() no longer runs it: it checks the files, blobs,
tensors and tree by hand; the figure shows what that saves).

    python benchmarks/bench_manifest.py            # ~2 min on 2 cores: 3 runs
    python benchmarks/bench_manifest.py --runs 1 --json out.json
    python benchmarks/bench_manifest.py --smoke    # 10,000 tensors, one run: does it run?

Prints figures only: nothing here passes or fails. The test suite runs ``--smoke``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from snapcore import manifest as mf

CHILD = r"""
import json, resource, sys, time
from snapcore import manifest as mf

path, mode = sys.argv[1:]
data = open(path, "rb").read()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
if mode == "parse":  # parse alone: its time and peak memory
    t0 = time.perf_counter()
    m = mf.parse(data, where=path)
    out = {"parse_s": time.perf_counter() - t0, "tensors": len(m.tensors)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["peak_rss_mib"], out["peak_rss_total_mib"] = (peak - base) / 1024, peak / 1024
else:  # JSON as parse() decodes it (duplicate-key hook); the whole schema, for comparison
    t0 = time.perf_counter()
    doc = json.loads(data, object_pairs_hook=mf._object)
    t1 = time.perf_counter()
    mf._validator()(doc)  # parse() checks the big arrays and the tree by hand instead
    out = {"json_s": t1 - t0, "schema_s": time.perf_counter() - t1}
print(json.dumps(out))
"""


def _child(path: Path, mode: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), mode], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out)


def manifest_with(n: int) -> bytes:
    """A valid manifest of ``n`` tensors, views of 8 float32 each into one blob: the most
    tensors (and so the most JSON objects) a 64 MiB manifest can hold."""
    data_file = "step-000000000001/data-000000000000-r0.bin"
    nbytes = 32 * n
    chunk = 64 << 20
    chunks = [
        {
            "file": 0,
            "offset": off,
            "length": min(chunk, nbytes - off),
            "raw_length": min(chunk, nbytes - off),
            "codec": "none",
            "xxh3": f"{k:032x}",
        }
        for k, off in enumerate(range(0, nbytes, chunk))
    ]
    tensors = [
        {
            "dtype": "float32",
            "shape": [8],
            "pieces": [
                {"offsets": [0], "shape": [8], "blob": 0, "byte_offset": 32 * i, "strides": [1]}
            ],
        }
        for i in range(n)
    ]
    items = [[f"l{i // 8}.p{i % 8}", {"tensor": i}] for i in range(n)]
    doc = {
        "format_version": mf.FORMAT_VERSION,
        "kind": mf.KIND,
        "step": 1,
        "created_unix": 1.0,
        "writer": {"snapcore": "bench"},
        "world_size": 1,
        "rank_files": [[0]],
        "files": [{"name": data_file, "size": nbytes}],
        "blobs": [{"nbytes": nbytes, "element_size": 4, "chunks": chunks}],
        "tensors": tensors,
        "tree": {"dict": items},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def largest_manifest() -> bytes:
    per = len(manifest_with(1000)) / 1000
    n = int(mf.MAX_MANIFEST_BYTES / per)
    data = manifest_with(n)
    while len(data) > mf.MAX_MANIFEST_BYTES:
        n = int(n * 0.99)
        data = manifest_with(n)
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--smoke", action="store_true", help="10,000 tensors, one run")
    args = ap.parse_args()
    if args.smoke:
        args.runs = 1
    data = manifest_with(10_000) if args.smoke else largest_manifest()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "manifest.json"
        path.write_bytes(data)
        runs = [{**_child(path, "parse"), **_child(path, "phases")} for _ in range(args.runs)]
    print(
        f"manifest: {len(data) / 2**20:.1f} MiB, {runs[0]['tensors']} tensors; "
        f"{platform.node()}, {os.cpu_count()} cores, python {platform.python_version()}"
    )
    print("run  parse_s  parse_peak_rss_mib  (process peak; phases: json.loads_s  schema_s)")
    for i, r in enumerate(runs):
        print(f"{i:>3}  {r['parse_s']:7.2f}  {r['peak_rss_mib']:18.0f}  ", end="")
        print(f"({r['peak_rss_total_mib']:.0f}; {r['json_s']:.2f}  {r['schema_s']:.2f})")
    if args.json:
        args.json.write_text(json.dumps({"bytes": len(data), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
