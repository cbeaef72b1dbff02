"""The native extension links nothing of torch's C++ ABI, the CUDA runtime or Python's
library, and opens only the CUDA driver at run time (issue 12: "a check that nothing in
the CUDA path calls into torch's C++ ABI"). The same check runs on the GPU machine
(benchmarks/bench_gpu.py), where the CUDA path is exercised."""

from __future__ import annotations

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
