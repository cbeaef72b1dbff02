"""Rank script: build each model kind named in argv[1] (comma-separated) and report, per
kind, its tensors' layout on this rank and digests of their global values, before
training ("init", model only) and after two steps (model and optimizer)."""

from __future__ import annotations

import os
import sys

import launch
import models


def main(kinds: list[str]) -> None:
    out = {}
    for kind in kinds:
        init = models.get_model_state(*models.build(kind, steps=0))["model"]
        state = models.get_model_state(*models.build(kind, steps=2))
        out[kind] = {
            "init": {k: models.digest(t) for k, t in models.global_tensors(init).items()},
            "layout": models.describe(state),
            "global": {k: models.digest(t) for k, t in models.global_tensors(state).items()},
        }
    launch.report(out)
    models.shutdown()
    # This script runs torch alone (no snapcore, nothing left to flush): skip the
    # interpreter's teardown, where gloo's threads sometimes abort the process even after
    # destroy_process_group (models.py, quirks); the report above is the result.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1].split(","))
