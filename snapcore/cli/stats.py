"""Numbers about tensors for ``diff`` and ``cat``, computed slice by slice in float64 so
that the temporaries stay small whatever the tensor's size."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import manifest as mf

SLICE = 1 << 22  # elements per slice: 32 MiB of float64 temporaries


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float64 (complex128 for a complex tensor)."""
    if t.is_complex():
        return t.to(torch.complex128)
    return t.to(torch.float64)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def num(x: float) -> float | str:
    """A number for JSON: ``"inf"``, ``"-inf"`` or ``"nan"`` when it is not finite."""
    return x if math.isfinite(x) else str(x)


def fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    if isinstance(x, complex):
        return f"({x.real:.6g}{x.imag:+.6g}j)"
    return str(x)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    fa, fb = _flat(a), _flat(b)
    for s in range(0, fa.numel(), SLICE):
        x = fa[s : s + SLICE].contiguous().view(torch.uint8)
        y = fb[s : s + SLICE].contiguous().view(torch.uint8)
        if not torch.equal(x, y):
            return False
    return True


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """``max_abs_diff`` (max |a - b|), ``rel_l2`` (||a - b|| / ||a||, inf when a is all
    zeros and b is not) and ``elements_changed`` of two tensors of one shape; elements
    equal as numbers (NaN beside NaN included) count as unchanged."""
    fa, fb = _flat(a), _flat(b)
    max_abs, sq_diff, sq_a, changed = 0.0, 0.0, 0.0, 0
    for s in range(0, fa.numel(), SLICE):
        x, y = _wide(fa[s : s + SLICE]), _wide(fb[s : s + SLICE])
        same = x == y
        if x.is_floating_point() or x.is_complex():
            same |= x.isnan() & y.isnan()
        d = (x - y).abs()
        d[same] = 0
        changed += int((~same).sum())
        if d.numel():
            m = float(d.max())
            max_abs = m if math.isnan(m) or math.isnan(max_abs) else max(max_abs, m)
        sq_diff += float((d * d).sum())
        sq_a += float((x.abs() ** 2).sum())
    rel = math.sqrt(sq_diff) / math.sqrt(sq_a) if sq_a else (math.inf if sq_diff else 0.0)
    return {"max_abs_diff": max_abs, "rel_l2": rel, "elements_changed": changed}


def summary(t: torch.Tensor) -> dict[str, Any]:
    """``min``, ``max``, ``mean``, ``std`` (over the finite elements) and, for floating
    and complex tensors, the number of ``nan`` and ``inf`` elements; a complex tensor's
    min, max, mean and std are of its absolute values. None where there is no element."""
    f = _flat(t)
    floating = t.is_floating_point() or t.is_complex()
    n, mean, m2, nans, infs = 0, 0.0, 0.0, 0, 0  # Chan et al.'s pairwise update
    lo: float | int = math.inf
    hi: float | int = -math.inf
    for s in range(0, f.numel(), SLICE):
        part = f[s : s + SLICE]
        x = _wide(part)
        if floating:
            nan = x.isnan()
            inf = x.isinf() & ~nan
            nans += int(nan.sum())
            infs += int(inf.sum())
            x = x[~(nan | inf)]
            if x.is_complex():
                x = x.abs()
        if not x.numel():
            continue
        k = x.numel()
        mean_k = float(x.mean())
        m2_k = float(((x - mean_k) ** 2).sum())
        delta = mean_k - mean
        mean += delta * k / (n + k)
        m2 += m2_k + delta * delta * n * k / (n + k)
        n += k
        if floating:
            lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
        else:  # exact, in the tensor's own integer type
            lo, hi = min(lo, int(part.min())), max(hi, int(part.max()))
    out: dict[str, Any] = {"min": None, "max": None, "mean": None, "std": None}
    if n:
        std = math.sqrt(m2 / (n - 1)) if n > 1 else 0.0
        out = {"min": lo, "max": hi, "mean": mean, "std": std}
    if floating:
        out["nan"] = nans
        out["inf"] = infs
    return out


def first_values(t: torch.Tensor, count: int) -> list[Any]:
    """The first ``count`` elements in row-major order, as Python numbers."""
    head = _flat(t)[:count]
    if head.is_floating_point() and head.dtype.itemsize < 4:
        head = head.float()  # bfloat16, float16 and float8 as float32
    return head.tolist()


def describe(t: mf.TensorEntry) -> str:
    shape = "x".join(map(str, t.shape)) or "scalar"
    return f"{t.dtype} [{shape}]"
