"""The method's statement, installed as ``lightning_stale.docs`` (``method.md``), so the sections
the docstrings cite ("docs/method.md, ...") are readable wherever the package is installed."""
