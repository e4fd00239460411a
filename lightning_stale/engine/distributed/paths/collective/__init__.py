"""The collective path: the sync family's gradients meet in one all-reduce."""
