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

    With the default options, ``state_dict()`` reuses what ``get_state_dict`` found while
    the state's structure is unchanged (about 2-3 ms of the training thread's time per
    save under FSDP2): the same parameter and buffer objects under the same names, with
    the same storage; the same parameters in the optimizers' groups; the same keys and
    tensor objects in their per-parameter state. Training updates all of these in place.
    Every call checks that structure again, and reads the optimizers' hyperparameters
    (``lr`` set by a scheduler...) and non-tensor state values fresh; on any difference,
    or when the reuse would not reproduce ``get_state_dict``'s result exactly (state dict
    hooks, extra state, other options), it calls ``get_state_dict`` again.
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
        # (structure key, model state dict, optimizer state's FQNs, groups' FQNs) or None
        self._cache: tuple[Any, dict[str, Any], list[list[tuple[Any, str]]], list[Any]] | None
        self._cache = None

    @property
    def __snapcore_optimizers__(self) -> list[torch.optim.Optimizer]:
        """The optimizers that write this state's tensors (overlap mode waits in their
        ``step()`` for the copies)."""
        return self.optimizers

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        key = self._structure() if self.options is None else None
        cache = self._cache
        if key is not None and cache is not None and cache[0] == key:
            return {"model": dict(cache[1]), "optim": self._optim_fresh(cache[2], cache[3])}
        self._cache = None
        model, optim = get_state_dict(self.model, self.optimizers, options=self.options)
        if key is not None:
            self._cache = self._reuse(key, model, optim)
        return {"model": model, "optim": optim}

    def _structure(self) -> tuple[Any, ...]:
        """What the reused result depends on: every parameter and buffer (name, object,
        local storage address, shape, dtype), and per optimizer its groups' parameters
        and the keys and tensor objects of its per-parameter state."""
        model: list[Any] = []
        for named in (self.model.named_parameters(), self.model.named_buffers()):
            for name, t in named:
                local = _local(t)
                model.append((name, id(t), local.data_ptr(), t.shape, t.dtype))
        optims: list[Any] = []
        for opt in self.optimizers:
            groups = tuple(tuple(id(p) for p in g["params"]) for g in opt.param_groups)
            state = tuple(
                (
                    id(p),
                    tuple(
                        (k, id(v) if isinstance(v, torch.Tensor) else None) for k, v in st.items()
                    ),
                )
                for p, st in opt.state.items()
            )
            optims.append((groups, state))
        return (tuple(model), tuple(optims))

    def _reuse(
        self, key: tuple[Any, ...], model: dict[str, Any], optim: dict[str, Any]
    ) -> tuple[Any, dict[str, Any], list[list[tuple[Any, str]]], list[Any]] | None:
        """The cache entry for ``get_state_dict``'s result, or None where rebuilding it
        from the live objects would not give that result exactly."""
        # Each model value must be a view of a parameter or buffer's storage (no extra
        # state, no tensor made by a hook): then it follows the in-place updates.
        live = {}
        for named in (self.model.named_parameters(), self.model.named_buffers()):
            for _, t in named:
                live[_local(t).data_ptr()] = t
        for v in model.values():
            if not isinstance(v, torch.Tensor):
                return None
            t = live.get(_local(v).data_ptr())
            if (
                t is None
                or t.shape != v.shape
                or t.dtype != v.dtype
                or (_local(t) is t) != (_local(v) is v)
            ):
                return None
        # The optimizers' state: rebuilt from the live state by parameter FQN.
        group_fqns: list[Any] = []
        saved_groups = optim.get("param_groups", [])
        saved_state = optim.get("state", {})
        gi = 0
        owner: dict[str, tuple[int, Any]] = {}  # FQN -> (optimizer index, parameter)
        for o, opt in enumerate(self.optimizers):
            for g in opt.param_groups:
                if gi >= len(saved_groups):
                    return None
                names = list(saved_groups[gi]["params"])
                if len(names) != len(g["params"]):
                    return None
                group_fqns.append(names)
                for p, n in zip(g["params"], names, strict=True):
                    owner[n] = (o, p)
                gi += 1
        if gi != len(saved_groups):
            return None
        # In the order get_state_dict gave (the snapshot's paths keep their order).
        fqn_state: list[list[tuple[Any, str]]] = [[] for _ in self.optimizers]
        for n in saved_state:
            if n not in owner:
                return None
            o, p = owner[n]
            if p not in self.optimizers[o].state:
                return None
            fqn_state[o].append((p, n))
        entry = (key, dict(model), fqn_state, group_fqns)
        if not _same(self._optim_fresh(fqn_state, group_fqns), optim):
            return None
        return entry

    def _optim_fresh(
        self, fqn_state: list[list[tuple[Any, str]]], group_fqns: list[Any]
    ) -> dict[str, Any]:
        """The optimizers' state dict from their live state: tensors (updated in place),
        non-tensor values and hyperparameters as they are now."""
        state: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        gi = 0
        for opt, pairs in zip(self.optimizers, fqn_state, strict=True):
            for p, name in pairs:
                state[name] = dict(opt.state[p])
            for g in opt.param_groups:
                group = {k: v for k, v in g.items() if k != "params"}
                group["params"] = list(group_fqns[gi])
                groups.append(group)
                gi += 1
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict.get("optim", {}),
            options=self.options,
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (any other tensor: itself)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _same(a: Any, b: Any) -> bool:
    """Whether two state dicts hold the same structure, the same tensor objects and
    equal other values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False
