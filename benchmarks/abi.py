"""Does the native extension call into torch's C++ ABI? (issue 12: "a check that nothing in
the CUDA path calls into torch's C++ ABI").

snapcore's extension is built without torch (nanobind, no torch headers at build time)
and opens the CUDA driver itself (``dlopen("libcuda.so.1")``), so that one wheel works
with every torch and CUDA version. This reads the built module's dynamic section and
dynamic symbol table (binutils' ``readelf`` and ``nm``) and reports:

- ``needed``: its DT_NEEDED libraries; none may be torch's (libtorch*, libc10*,
  libshm), CUDA's runtime or driver (libcudart, libcuda: the driver is opened at run
  time), or Python's (nanobind links none);
- ``torch_symbols``: undefined symbols in torch's C++ namespaces (``c10::``, ``at::``,
  ``torch::``, ``caffe2::``), which would tie the module to one torch build;
- ``cuda_symbols``: undefined symbols of the CUDA runtime or driver (``cuda*``,
  ``cu[A-Z]*``): the driver's entry points are looked up at run time instead;
- ``opened``: the library names the module's bytes hold (what it may ``dlopen``):
  libcuda.so.1 and libnuma.so.1 are expected; torch's, the CUDA runtime's or Python's
  are ``forbidden_opened``;
- ``stdlib_exported``: strong definitions of the C++ runtime's symbols (``std::``,
  ``__cxa_*``, ``__gnu_cxx::``) that the module exports, as one does that links
  libstdc++ statically without hiding it: they interpose on the process's own
  libstdc++ (torch's), and the two copies' state mixes (the GPU machine's build crashed
  in ``std::ifstream`` so). Weak template instantiations of the module's own code are
  not counted.

    python benchmarks/abi.py            # the installed snapcore._native; exit 1 if it fails
    python benchmarks/abi.py --json     # the report as JSON
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

FORBIDDEN_LIBS = re.compile(r"^(libtorch|libc10|libshm|libcudart|libcuda\.|libpython)")
TORCH_NAMESPACE = re.compile(r"(^|[^\w:])(c10|at|torch|caffe2)::")
CUDA_SYMBOL = re.compile(r"^(cuda[A-Z]\w*|cu[A-Z]\w*)(@|$)")
LIBRARY_NAME = re.compile(rb"lib[\w.+-]*\.so(?:\.\d+)*")
# mangled names of the C++ runtime: std:: (functions, members, typeinfo, vtables), the ABI
STDLIB_SYMBOL = re.compile(
    r"^(_Z(N|NK|T[ISV]N?)?St|_ZSt|__cxa_|__gxx_|_ZN9__gnu_cxx|_ZN10__cxxabiv1)"
)


def native_module() -> Path:
    """The path of the installed extension module."""
    from snapcore import _native

    return Path(_native.__file__)


def _run(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    except FileNotFoundError as e:
        raise RuntimeError(f"{argv[0]} is needed to read {argv[-1]} (binutils)") from e


def report(path: Path | None = None) -> dict[str, Any]:
    """What the module at ``path`` (default: the installed one) links and imports."""
    path = path or native_module()
    needed = re.findall(
        r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _run("readelf", "-dW", str(path))
    )
    undefined = [
        line.split(None, 1)[1].strip()
        for line in _run("nm", "-DC", "--undefined-only", str(path)).splitlines()
        if line.strip() and len(line.split(None, 1)) == 2
    ]
    bad_libs = [n for n in needed if FORBIDDEN_LIBS.match(n)]
    torch_symbols = [s for s in undefined if TORCH_NAMESPACE.search(s)]
    cuda_symbols = [s for s in undefined if CUDA_SYMBOL.match(s)]
    opened = sorted({m.decode() for m in LIBRARY_NAME.findall(path.read_bytes())} - set(needed))
    bad_opened = [n for n in opened if FORBIDDEN_LIBS.match(n) and n != "libcuda.so.1"]
    stdlib_exported = [
        parts[2]
        for parts in (
            ln.split() for ln in _run("nm", "-D", "--defined-only", str(path)).splitlines()
        )
        if len(parts) == 3 and parts[1] in "TDBR" and STDLIB_SYMBOL.match(parts[2])
    ]
    return {
        "module": str(path),
        "needed": needed,
        "undefined": len(undefined),
        "forbidden_needed": bad_libs,
        "torch_symbols": torch_symbols,
        "cuda_symbols": cuda_symbols,
        "opened": opened,
        "forbidden_opened": bad_opened,
        "stdlib_exported": stdlib_exported,
        "ok": not (bad_libs or torch_symbols or cuda_symbols or bad_opened or stdlib_exported),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("module", nargs="?", default=None, help="default: snapcore._native")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    r = report(Path(args.module) if args.module else None)
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print(f"{r['module']}: needs {', '.join(r['needed'])}; {r['undefined']} undefined symbols")
        print(f"  names in its bytes: {', '.join(r['opened']) or 'none'}")
        for key in ("forbidden_needed", "torch_symbols", "cuda_symbols", "forbidden_opened"):
            for item in r[key]:
                print(f"  {key}: {item}")
        if r["stdlib_exported"]:
            print(f"  stdlib_exported: {len(r['stdlib_exported'])} symbols of the C++ runtime, "
                  f"e.g. {r['stdlib_exported'][0]}")  # fmt: skip
        print(
            "OK: no torch C++ ABI, no CUDA runtime, no C++ runtime exported" if r["ok"] else "FAIL"
        )
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
