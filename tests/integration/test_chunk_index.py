"""The chunk index (snapcore/write/chunks.py) against another writer: a step still
listed whose directory was replaced by another commit of the same step number is read
again, so a later save does not share chunks that are gone."""

from __future__ import annotations

import shutil

import torch

import snapcore
from snapcore.directory import step_dir_name


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(1 << 16, generator=g) for i in range(4)}


def test_a_step_replaced_by_another_writer_is_not_shared(tmp_path):
    root, other = tmp_path / "store", tmp_path / "other"
    x, y = state(1), state(2)
    snapcore.save(x, root, step=1)  # this engine indexes step 1's chunks (x)
    snapcore.wait_all(root)
    # another writer removes step 1 and commits a different step 1 in its place
    snapcore.save(y, other, step=1)
    snapcore.wait_all(other)
    shutil.rmtree(root / step_dir_name(1))
    shutil.copytree(other / step_dir_name(1), root / step_dir_name(1))
    snapcore.save(x, root, step=2)  # x's chunks are not in step 1 any more
    snapcore.wait_all(root)
    for step, want in ((1, y), (2, x)):
        got = snapcore.load(root, step=step)
        assert set(got) == set(want)
        for k, v in want.items():
            assert torch.equal(got[k].view(torch.int32), v.view(torch.int32)), (step, k)
