"""The rank runtime's distributed parts: group setup, hosts, step-plan broadcast, wake
channel, watchdog, split planning, sharding, pipeline stages and the per-rank loader."""
