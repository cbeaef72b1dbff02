"""Planning: where every byte of a snapshot goes. Pure functions of the state's tensors,
testable with no process group and no I/O."""
