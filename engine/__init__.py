"""Model resolution, batch engine, sampler, scheduler."""
