"""lightning_stale."""
