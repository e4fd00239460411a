"""The sharded path: every rank owns a slice of the parameters and of the optimizer state."""
