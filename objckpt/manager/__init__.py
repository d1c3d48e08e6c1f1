"""CheckpointManager: numbered steps, async saves, retention, gc."""
