"""Serving on the ranks: the step plan, the batch engine, and rank 0's leader, scheduler,
sampler and detokenizer."""
