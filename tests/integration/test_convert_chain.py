"""One state through every format: snapcore -> safetensors -> snapcore -> DCP -> snapcore
-> torch.save, and every tensor comes back bit-exact (issue 11's round trip): all the
dtypes the formats share, bf16 and fp8 included, 0-d, empty and non-contiguous tensors,
and the plain values that every format carries."""

from __future__ import annotations

from pathlib import Path

import torch

import snapcore
from snapcore.convert import convert


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 5, generator=g)
    return {
        "f32": base,
        "f16": torch.randn(4, 3, generator=g).half(),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f64": torch.randn(2, 2, generator=g).double(),
        "i64": torch.arange(-5, 5),
        "i32": torch.arange(12, dtype=torch.int32).reshape(3, 4),
        "u8": torch.arange(200, 210, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "fp8": (torch.randn(8, generator=g) * 4).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed": torch.randn(3, 4, generator=g).t(),  # non-contiguous
    }


def _bits(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    flat = t.contiguous().reshape(-1)
    return str(t.dtype), tuple(t.shape), bytes(flat.view(torch.uint8).numpy()) if t.numel() else b""


def test_every_tensor_survives_every_format(tmp_path: Path) -> None:
    state = _state()
    snapcore.save({"model": state, "step": 7, "lr": 0.001}, tmp_path / "s0", step=7)
    chain = [("safetensors", "a.safetensors"), ("snapcore", "s1"), ("dcp", "d"),
             ("snapcore", "s2"), ("torch", "t.pt")]  # fmt: skip
    src = tmp_path / "s0"
    for fmt, name in chain:
        dst = tmp_path / name
        convert(src, dst, to=fmt)
        src = dst
    final = torch.load(src, weights_only=True)
    model = final["model"]
    assert set(model) == set(state)
    for name, t in state.items():
        assert _bits(model[name]) == _bits(t), name
    assert final["step"] == 7 and final["lr"] == 0.001
    snapcore.close()
