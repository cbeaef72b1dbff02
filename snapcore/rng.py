"""RNGState: the process's global random number generators as one Stateful.

Put ``snapcore.RNGState()`` in the state and a restore puts every generator back where it
was, so that a resumed run draws the same numbers as one that never stopped:

    state = {"model": model, "optim": optim, "rng": snapcore.RNGState()}
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from .errors import StateMismatch

log = logging.getLogger(__name__)


class RNGState:
    """Python's ``random``, NumPy's global ``np.random``, torch's CPU generator and the
    generator of every CUDA device, through ``state_dict()`` / ``load_state_dict()``.

    The state dict holds ``python`` (a ``random.Random`` with the global state),
    ``numpy`` (``np.random.get_state(legacy=False)``, or None where NumPy is not
    installed), ``torch`` (``torch.get_rng_state()``) and ``cuda``
    (``torch.cuda.get_rng_state_all()``, or None where CUDA is not initialised: this does
    not initialise it, and a process that never used CUDA has no CUDA draws to resume).
    Loading sets each generator that was saved; a saved CUDA state for a device this
    process lacks, or saved CUDA states where CUDA is unavailable, is logged as a warning
    and skipped.

    Under torch.distributed each rank's generators are its own: the object is rank-local
    (saved by each rank in its part, restored to the same rank; docs/distributed.md).
    """

    __snapcore_rank_local__ = True

    def state_dict(self) -> dict[str, Any]:
        python = random.Random()
        python.setstate(random.getstate())
        try:
            import numpy
        except ImportError:
            np_state = None
        else:
            np_state = numpy.random.get_state(legacy=False)
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return {"python": python, "numpy": np_state, "torch": torch.get_rng_state(), "cuda": cuda}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        python = state_dict["python"]
        random.setstate(python.getstate() if isinstance(python, random.Random) else python)
        if state_dict.get("numpy") is not None:
            try:
                import numpy
            except ImportError:
                raise StateMismatch(
                    "RNGState: the snapshot holds NumPy's random state and NumPy is not "
                    "installed (pip install numpy)"
                ) from None
            numpy.random.set_state(state_dict["numpy"])
        torch.set_rng_state(state_dict["torch"])
        cuda = state_dict.get("cuda")
        if cuda is None:
            return
        present = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for device, state in enumerate(cuda[:present]):
            torch.cuda.set_rng_state(state, device)
        if len(cuda) > present:
            log.warning(
                "RNGState: the snapshot holds the RNG state of %d CUDA devices and this "
                "process has %d: devices %d to %d are not restored",
                len(cuda),
                present,
                present,
                len(cuda) - 1,
            )
