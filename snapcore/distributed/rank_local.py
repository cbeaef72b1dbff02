"""``RankLocal``: a value that each rank of a job saves for itself."""

from __future__ import annotations

from typing import Any


class RankLocal:
    """Wrap a value each rank keeps for itself (a data loader's position, a per-rank
    counter or tensor): under torch.distributed it is saved in each rank's part and
    restored to the same rank, never shared or deduplicated across ranks.

    ``value`` is anything snapcore saves (a dict, a tensor, an object with
    ``state_dict()``). A restore treats ``.value`` as it would the same value in the
    state: a dict or list is filled in place, key by key (the caller's object stays the
    one it holds), tensors are copied into, and with ``strict=True`` a key the snapshot
    lacks raises ``StateMismatch``; a plain value (a number, a string) is replaced.
    Restoring into another world size refuses a rank-local value
    whose ranks saved different values (``restore(..., rank_local="keep")`` leaves it
    as it is instead). Outside torch.distributed it is an ordinary value.
    """

    __snapcore_rank_local__ = True
    __snapcore_holds__ = "value"  # restore plans ``.value`` as part of the state (tree.py)

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = state_dict["value"]

    def __repr__(self) -> str:
        return f"RankLocal({self.value!r})"
