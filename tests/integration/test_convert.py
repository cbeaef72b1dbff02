"""snapcore convert (docs/cli.md, "convert"): safetensors and snapcore, both ways, judged by
the safetensors library itself and by transformers' from_pretrained."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import snapcore
from snapcore.cli.main import main as cli
from snapcore.convert import FORMATS, convert
from snapcore.convert import safetensors_fmt as stf

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, load_model, save_file  # noqa: E402


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "f32": torch.randn(4, 6, generator=g),
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).to(torch.float16),
        "i64": torch.arange(-5, 5, dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(3, 5, generator=g).t(),  # not contiguous at save time
    }
    if hasattr(torch, "float8_e4m3fn"):
        out["fp8"] = torch.randn(8, generator=g).to(torch.float8_e4m3fn)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.contiguous()
        .view(-1)
        .view(torch.uint8)
        .equal(b.contiguous().view(-1).view(torch.uint8))
        if a.numel()
        else a.dtype == b.dtype and a.shape == b.shape
    )


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= _flat(v, name + ".")
        else:
            out[name] = v
    return out


@pytest.fixture
def store(tmp_path: Path) -> Path:
    emb = torch.randn(10, 4)
    state = {
        "model": {"embed": emb, "head": emb, **_tensors()},
        "optim": {"lr": 0.001, "name": "adam", "betas": [0.9, 0.999], "eps": None},
        "step": 7,
    }
    snapcore.save(state, tmp_path / "store", step=5)
    return tmp_path / "store"


def test_formats_registered() -> None:
    assert {"safetensors", "snapcore"} <= set(FORMATS)


def test_snapcore_to_single_file(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    stats = convert(store, out, to="safetensors")
    loaded = load_file(out)
    saved = _flat(snapcore.load(store))
    # tied weights: written once, the alias recorded as save_model does
    assert "model.head" not in loaded and stats.aliases == 1
    with safe_open(out, framework="pt") as f:
        meta = f.metadata()
    assert meta["model.head"] == "model.embed"
    assert json.loads(meta["snapcore.values"]) == {
        "optim.lr": 0.001,
        "optim.name": "adam",
        "optim.betas.0": 0.9,
        "optim.betas.1": 0.999,
        "optim.eps": None,
        "step": 7,
    }
    assert meta["snapcore.step"] == "5"
    for name, t in loaded.items():
        assert _same(t, saved[name]), name
    assert set(loaded) == {n for n, v in saved.items() if isinstance(v, torch.Tensor)} - {
        "model.head"
    }
    # safetensors' own load_model re-ties the alias
    root, m = torch.nn.Module(), torch.nn.Module()
    root.model = m
    m.embed = torch.nn.Parameter(torch.zeros(10, 4))
    m.head = m.embed
    missing, _ = load_model(root, out, strict=False)
    assert not missing
    assert m.embed.equal(saved["model.embed"]) and m.head is m.embed


def test_snapcore_to_sharded(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    convert(store, out, to="safetensors", shard_size=64)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    saved = _flat(snapcore.load(store))
    total = 0
    for name, shard in index["weight_map"].items():
        with safe_open(out / shard, framework="pt") as f:
            t = f.get_tensor(name)
        assert _same(t, saved[name]), name
        total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    for shard in shards:  # each shard on its own
        assert load_file(out / shard)
        assert (out / shard).stat().st_size <= 64 + 2048 or len(load_file(out / shard)) == 1


def test_round_trip_bit_exact(tmp_path: Path) -> None:
    src = _tensors()
    save_file({k: v.contiguous() for k, v in src.items()}, tmp_path / "a.safetensors")
    convert(tmp_path / "a.safetensors", tmp_path / "store", to="snapcore")
    back = snapcore.load(tmp_path / "store", step=0)
    for k, v in src.items():
        assert _same(v, back[k]), k
    convert(tmp_path / "store", tmp_path / "b.safetensors", to="safetensors")
    again = load_file(tmp_path / "b.safetensors")
    assert set(again) == set(src)
    for k, v in src.items():
        assert _same(v, again[k]), k


def test_ties_survive_round_trip(store: Path, tmp_path: Path) -> None:
    convert(store, tmp_path / "a.safetensors", to="safetensors")
    convert(tmp_path / "a.safetensors", tmp_path / "s2", to="snapcore", step=3)
    back = snapcore.load(tmp_path / "s2", step=3)
    assert back["model"]["head"] is back["model"]["embed"] or (
        back["model"]["head"].data_ptr() == back["model"]["embed"].data_ptr()
    )
    assert back["optim"] == {
        "lr": 0.001,
        "name": "adam",
        "betas": {"0": 0.9, "1": 0.999},
        "eps": None,
    }


def test_filters(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "f.safetensors"
    convert(
        store,
        out,
        to="safetensors",
        only=["model.f*", "model.bf16", "model.embed"],
        strip_prefix="model.",
        rename=[(r"^f(\d+)$", r"float\1")],
        dtype=torch.bfloat16,
    )
    loaded = load_file(out)
    names = {"float32", "float16", "bf16", "embed"} | ({"fp8"} if "fp8" in _tensors() else set())
    assert set(loaded) == names
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())
    saved = snapcore.load(store)["model"]
    assert loaded["float32"].equal(saved["f32"].to(torch.bfloat16))


def test_dtype_leaves_integers(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "d.safetensors"
    convert(store, out, to="safetensors", only=["model.i64", "model.bool"], dtype=torch.float16)
    loaded = load_file(out)
    assert loaded["model.i64"].dtype == torch.int64 and loaded["model.bool"].dtype == torch.bool


def test_name_collision_refused(store: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="both renamed"):
        convert(store, tmp_path / "x.safetensors", to="safetensors", rename=[(".*", "a")])
    assert not (tmp_path / "x.safetensors").exists()


def test_existing_target_refused(store: Path, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        convert(store, tmp_path / "full", to="safetensors")
    (tmp_path / "file.safetensors").write_text("x")
    with pytest.raises(FileExistsError):
        convert(store, tmp_path / "file.safetensors", to="safetensors")
    (tmp_path / "empty").mkdir()
    convert(store, tmp_path / "empty", to="safetensors")
    assert (tmp_path / "empty" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("to", "shard_size"), [("safetensors", 64), ("snapcore", 5 * 10**9), ("dcp", 5 * 10**9)]
)
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interrupted_leaves_no_target(
    store: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    to: str,
    shard_size: int,
    exc: type,
) -> None:
    source = FORMATS["snapcore"].source
    calls = []

    class Failing:
        def __init__(self, path: Any, options: dict[str, Any]) -> None:
            self.inner = source(path, options)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def _count(self, info: Any) -> None:
            calls.append(info.name)
            if len(calls) == 3:
                raise exc("boom")

        def read(self, info: Any) -> torch.Tensor:
            self._count(info)
            return self.inner.read(info)

        def read_into(self, info: Any, start: Any, stop: Any, buf: Any) -> torch.Tensor:
            self._count(info)  # a safetensors or snapcore target: reused buffers
            return self.inner.read_into(info, start, stop, buf)

    monkeypatch.setitem(
        FORMATS,
        "snapcore",
        FORMATS["snapcore"].__class__(
            "snapcore", FORMATS["snapcore"].detect, Failing, FORMATS["snapcore"].sink
        ),
    )
    target = tmp_path / "out"
    with pytest.raises(exc, match="boom"):
        convert(store, target, to=to, shard_size=shard_size)
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # no temporary left


def test_ranges_write_what_whole_tensors_write(tmp_path: Path) -> None:
    """A tensor larger than the window goes in ranges (safetensors source; safetensors and
    snapcore targets, a cast on the way): the output is the one whole tensors give."""
    from snapcore.directory import LocalDirectory

    g = torch.Generator().manual_seed(1)
    src = {
        "big": torch.randn(1000, 33, generator=g),
        "bf": torch.randn(513, generator=g).bfloat16(),
        "ints": torch.arange(999, dtype=torch.int32),
        "small": torch.ones(3),
    }
    save_file(src, tmp_path / "a.safetensors")
    a = tmp_path / "a.safetensors"
    for w in (None, 1000):
        stats = convert(a, tmp_path / f"st-{w}.safetensors", to="safetensors", window=w)
        assert (stats.tensors, stats.bytes) == (4, sum(t.nbytes for t in src.values()))
        convert(a, tmp_path / f"sc-{w}", to="snapcore", window=w)
        convert(a, tmp_path / f"bf-{w}", to="snapcore", window=w, dtype=torch.bfloat16)
    whole, ranged = (tmp_path / "st-None.safetensors", tmp_path / "st-1000.safetensors")
    assert whole.read_bytes() == ranged.read_bytes()
    for name in ("sc", "bf"):
        m1 = LocalDirectory(tmp_path / f"{name}-None").read_manifest(0)
        m2 = LocalDirectory(tmp_path / f"{name}-1000").read_manifest(0)
        assert m1.tree == m2.tree
        assert [[c.xxh3 for c in b.chunks] for b in m1.blobs] == [
            [c.xxh3 for c in b.chunks] for b in m2.blobs
        ]
    back = snapcore.load(tmp_path / "sc-1000")
    cast = snapcore.load(tmp_path / "bf-1000")
    for k, v in src.items():
        assert _same(v, back[k]), k
        assert _same(v.bfloat16() if v.is_floating_point() else v, cast[k]), k


def test_window_must_be_positive(store: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="window"):
        convert(store, tmp_path / "out", to="safetensors", window=0)


def test_cli(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    code = cli(
        [
            "convert",
            str(store),
            str(out),
            "--to",
            "safetensors",
            "--shard-size",
            "100B",
            "--only",
            "model.*",
            "--strip-prefix",
            "model.",
            "--quiet",
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert "tied" in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").is_file()
    assert cli(["convert", str(store), str(out), "--to", "safetensors"]) == 1
    assert "not empty" in capsys.readouterr().err
    assert cli(["convert", str(store), str(tmp_path / "y")]) == 2
    assert cli(["convert", str(store), str(tmp_path / "y"), "--to", "nope"]) == 2
    assert (
        cli(["convert", str(store), str(tmp_path / "y"), "--to", "safetensors", "--rename", "x"])
        == 2
    )
    assert cli(["convert", str(tmp_path / "nope"), str(tmp_path / "y"), "--to", "snapcore"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "No such file" in err
    big = tmp_path / "big.safetensors"
    assert cli(["convert", str(store), str(big), "--to", "safetensors", "--shard-size", "10"]) == 1
    assert "give a directory" in capsys.readouterr().err and not big.exists()


def test_transformers_round_trip(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert(tmp_path / "hf", tmp_path / "store", to="snapcore")
    out = tmp_path / "hf2"
    convert(tmp_path / "store", out, to="safetensors", shard_size=4096)
    assert (out / "model.safetensors.index.json").is_file()
    (out / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    again = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    a, b = model.state_dict(), again.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].equal(b[k]), k
    assert again.lm_head.weight.data_ptr() == again.transformer.wte.weight.data_ptr()
    ids = torch.tensor([[1, 2, 3]])
    assert model(ids).logits.equal(again(ids).logits)


def test_detect(store: Path, tmp_path: Path) -> None:
    assert FORMATS["snapcore"].detect(store)
    assert not FORMATS["safetensors"].detect(store)
    save_file({"a": torch.ones(1)}, tmp_path / "a.safetensors")
    assert stf.detect(tmp_path / "a.safetensors")
    assert not FORMATS["snapcore"].detect(tmp_path / "a.safetensors")


def test_reads_reuse_two_buffers_where_the_sink_lets_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Into a safetensors or local snapcore target the source reads into two buffers
    allocated once (faulted once), whatever the number of tensors, and the output is
    the same; into a target that keeps its tensors (DCP) it reads into new memory."""
    g = torch.Generator().manual_seed(2)
    src = {f"t{i}": torch.randn(100 + 37 * i, generator=g) for i in range(12)}
    src["big"] = torch.randn(5000, generator=g)  # ranges of a 4000-byte window
    save_file(src, tmp_path / "a.safetensors")
    used: list[int | None] = []
    real = stf.SafetensorsSource.read_into

    def spy(self: Any, info: Any, start: Any, stop: Any, buf: Any) -> torch.Tensor:
        used.append(None if buf is None else buf.data_ptr())
        return real(self, info, start, stop, buf)

    monkeypatch.setattr(stf.SafetensorsSource, "read_into", spy)
    for to, window in (("safetensors", 4000), ("snapcore", 4000), ("snapcore", None)):
        used.clear()
        out = tmp_path / (f"{to}-{window}" + (".safetensors" if to == "safetensors" else ""))
        convert(tmp_path / "a.safetensors", out, to=to, window=window)
        assert len(used) >= len(src) and None not in used, (to, used)
        assert len(set(used)) == 2, (to, window, len(set(used)))
        back = load_file(out) if to == "safetensors" else snapcore.load(out)
        assert all(_same(v, back[k]) for k, v in src.items())
    used.clear()
    convert(tmp_path / "a.safetensors", tmp_path / "dcp", to="dcp")
    assert used and set(used) == {None}  # DCP keeps tensors until its plan writes them


def _big_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, Any]]:
    """A store of 1 MiB chunks: a 4 MiB tensor of 4 chunks, small ones of one chunk."""
    monkeypatch.setenv("SNAPCORE_CHUNK_MB", "1")
    g = torch.Generator().manual_seed(3)
    src: dict[str, Any] = {
        "big": torch.randn(1024, 1024, generator=g),
        "bf": torch.randn(700, generator=g).bfloat16(),
        "ints": torch.arange(999, dtype=torch.int32),
        "view": torch.randn(8, 6, generator=g)[2:5],  # a view of a larger tensor
    }
    snapcore.save(src, tmp_path / "store", step=1)
    monkeypatch.delenv("SNAPCORE_CHUNK_MB")
    return tmp_path / "store", src


def test_snapcore_source_reads_chunks_into_the_reused_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Into a safetensors target a snapcore source reads the chunks of each tensor (or
    range of one) into the converter's two buffers; a range that does not cover whole
    chunks (a window smaller than a chunk) is cut from the tensor read whole. The
    output is the same file every way."""
    from snapcore.convert import snapcore_fmt as scf

    store, src = _big_store(tmp_path, monkeypatch)
    into: list[int] = []  # the buffer each result lies in, or 0: new memory
    real = scf.SnapcoreSource.read_into

    def spy(self: Any, info: Any, start: Any, stop: Any, buf: Any) -> torch.Tensor:
        t = real(self, info, start, stop, buf)
        lo = buf.data_ptr() if buf is not None else -1
        inside = buf is not None and lo <= t.data_ptr() < lo + buf.numel()
        into.append(lo if inside else 0)
        return t

    monkeypatch.setattr(scf.SnapcoreSource, "read_into", spy)
    outs = {}
    for window in (None, 2 << 20, 300_000):
        into.clear()
        out = tmp_path / f"out-{window}.safetensors"
        convert(store, out, to="safetensors", window=window)
        outs[window] = out.read_bytes()
        back = load_file(out)
        assert all(_same(v, back[k]) for k, v in src.items())
        if window == 300_000:  # big in 14 ranges, from the tensor read whole
            assert into.count(0) >= 14, into
        else:  # every tensor, or 2 MiB range of big (2 chunks), into the two buffers
            assert 0 not in into and len(set(into)) == 2, (window, into)
    assert outs[None] == outs[2 << 20] == outs[300_000]


@pytest.mark.parametrize("damage", ["flip", "truncate", "truncate-after-open"])
def test_snapcore_source_damage_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A damaged store read into the buffers fails the conversion with the file named
    (a byte flipped: the tensor, the chunk and its xxh3; a data file cut short before
    the conversion: its size; cut short once the source is open: the tensor whose read
    found it), and leaves no target."""
    from snapcore.convert import snapcore_fmt as scf
    from snapcore.errors import CorruptSnapshot

    store, src = _big_store(tmp_path, monkeypatch)
    (data,) = store.glob("step-*/data-*.bin")
    raw = data.read_bytes()
    big = raw.find(src["big"].view(-1).view(torch.uint8).numpy().tobytes())
    assert big >= 0
    if damage == "flip":
        at = big + (3 << 20) + 5  # in the 4th of big's 1 MiB chunks
        data.write_bytes(raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1 :])
    elif damage == "truncate":
        data.write_bytes(raw[: big + (3 << 20)])
    else:
        real = scf.SnapcoreSource.__init__

        def cut(self: Any, path: Any, options: dict[str, Any]) -> None:
            real(self, path, options)  # sizes checked against the manifest here
            os.truncate(data, big + (3 << 20))

        monkeypatch.setattr(scf.SnapcoreSource, "__init__", cut)
    out = tmp_path / "out"
    with pytest.raises(CorruptSnapshot) as e:
        convert(store, out, to="safetensors", window=2 << 20)
    assert data.name in str(e.value)
    if damage == "flip":
        assert "'big' chunk 3" in str(e.value) and "xxh3" in str(e.value)
    elif damage == "truncate-after-open":
        assert "'big' chunk" in str(e.value)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # no temporary left
