"""The server paths, each a plug-in in a folder of its own (`paths.base` declares what a path
implements; `paths.registry` holds them by name and decides which one runs)."""
