"""Group setup, step-plan broadcast, wake channel, watchdog, split planning and sharding."""
