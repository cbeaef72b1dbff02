"""Planning: where every byte of a snapshot goes. Pure functions of the state's tensors,
testable with no process group and no I/O.

``layout``: where each tensor's bytes go in a data file. ``global_plan``: the global save
plan, the node copies and the resharding read plan of issue 10, which sharded saves
(``write/sharded.py``) and restores (``read.py``) use."""
