"""Service routes (health, cluster info, metrics), one module per area."""
