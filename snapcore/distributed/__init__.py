"""snapcore under torch.distributed: sharded snapshots (docs/distributed.md).

Under an initialised process group, ``snapcore.save / async_save / restore`` take
DTensors (FSDP2, tensor parallel, HSDP), plain tensors replicated by DDP or by
convention, and rank-local values, and each rank writes only what it owns. This package
holds what a user needs beyond that: ``AppState`` (a model and its optimizers through
``torch.distributed.checkpoint.state_dict``) and ``RankLocal`` (a value each rank keeps
for itself).
"""

from __future__ import annotations

from .app_state import AppState
from .rank_local import RankLocal

__all__ = ["AppState", "RankLocal"]
