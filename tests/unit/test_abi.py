"""The native extension links nothing of torch's C++ ABI, the CUDA runtime or Python's
library, and opens only the CUDA driver at run time (issue 12: "a check that nothing in
the CUDA path calls into torch's C++ ABI"). The same check runs on the GPU machine
(benchmarks/bench_gpu.py), where the CUDA path is exercised."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import abi


def test_the_native_module_calls_nothing_of_torchs_abi() -> None:
    r = abi.report()
    assert r["module"].endswith(".so") and "libc.so.6" in r["needed"], r
    assert r["undefined"] > 0  # the symbol table was read
    assert "libcuda.so.1" in r["opened"]  # the driver, opened at run time
    assert r["forbidden_needed"] == [] and r["torch_symbols"] == [], r
    assert r["cuda_symbols"] == [] and r["forbidden_opened"] == [], r
    assert r["stdlib_exported"] == [], r["stdlib_exported"][:5]
    assert r["ok"] is True
    assert abi.main([]) == 0


def test_the_check_catches_a_module_built_against_torch() -> None:
    """A negative control: torch's own Python binding is everything the check refuses."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_python.so"
    if not lib.exists():
        pytest.fail(f"{lib} is missing: this torch build has no libtorch_python.so")
    r = abi.report(lib)
    assert r["ok"] is False
    assert any(n.startswith("libtorch") for n in r["forbidden_needed"]), r["forbidden_needed"]
    assert any("c10::" in s for s in r["torch_symbols"])
    assert abi.main([str(lib)]) == 1


CXX_SOURCE = """
#include <fstream>
#include <string>
extern "C" int read_first(const char* path) {
  std::ifstream in(path);
  int v = -1;
  in >> v;
  return v;
}
"""


@pytest.mark.parametrize("hidden", [False, True], ids=["exported", "hidden"])
def test_the_check_catches_a_module_exporting_a_static_libstdcxx(tmp_path, hidden) -> None:
    """The GPU machine's toolchain linked libstdc++ statically, and the module exported it:
    std::ifstream crashed on the process's mixed libstdc++ state. A library built that
    way is refused; built with --exclude-libs,ALL (as CMakeLists.txt links the module),
    it passes."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.fail("no C++ compiler: the build of the native module needs one")
    (tmp_path / "m.cpp").write_text(CXX_SOURCE)
    lib = tmp_path / "libm.so"
    flags = ["-shared", "-fPIC", "-O1", "-static-libstdc++"]
    flags += ["-Wl,--exclude-libs,ALL"] if hidden else []
    subprocess.run([cxx, *flags, "-o", lib, tmp_path / "m.cpp"], check=True, timeout=120)
    r = abi.report(lib)
    if hidden:
        assert r["stdlib_exported"] == [] and r["ok"] is True, r["stdlib_exported"][:5]
    else:
        assert len(r["stdlib_exported"]) > 100 and r["ok"] is False
        assert any(s.startswith("_ZNSt6locale") for s in r["stdlib_exported"])
