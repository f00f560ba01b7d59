"""The compute every rank runs in lock-step: the step plan applied to the batch and its
caches, the forward (compiled where it can be), speculation's verify, prefix entries in
memory and on disk, the sampling ops, and the worker's step loop."""
