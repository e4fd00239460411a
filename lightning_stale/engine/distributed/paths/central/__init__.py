"""The central path: the server on rank 0 holds the parameters."""
