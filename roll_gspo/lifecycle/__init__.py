"""A run's lifecycle: crash-safe checkpoints, graceful stop, resumable random streams."""
