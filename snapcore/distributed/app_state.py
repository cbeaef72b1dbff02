"""``AppState``: a model and its optimizers as one Stateful, through
``torch.distributed.checkpoint.state_dict``: the one-liner DCP users write by hand."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class AppState:
    """``{"app": snapcore.distributed.AppState(model, optim)}`` saves and restores a
    model and its optimizers the way ``torch.distributed.checkpoint`` expects them:

    - ``state_dict()`` is ``get_state_dict(model, optimizers)``: the model's parameters
      and buffers (DTensor shards under FSDP2 / tensor parallel), keyed by their fully
      qualified names with DDP's ``module.`` and torch.compile's ``_orig_mod.`` removed,
      and the optimizers' state keyed by the same names instead of parameter ids (so the
      snapshot restores into another wrapping or sharding of the same model);
    - ``load_state_dict(sd)`` is ``set_state_dict``, which puts each value into its
      (possibly sharded) parameter or optimizer state.

    ``options`` is a ``torch.distributed.checkpoint.state_dict.StateDictOptions``.
    Works without a process group too (a plain model and optimizer).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
        *,
        options: Any = None,
    ) -> None:
        self.model = model
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        self.optimizers = list(optimizers)
        self.options = options

    @property
    def __snapcore_optimizers__(self) -> list[torch.optim.Optimizer]:
        """The optimizers that write this state's tensors (overlap mode waits in their
        ``step()`` for the copies)."""
        return self.optimizers

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizers, options=self.options)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict.get("optim", {}),
            options=self.options,
        )
