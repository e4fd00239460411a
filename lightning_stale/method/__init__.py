"""The method of Dutta et al. (AISTATS 2018) with no Lightning and no transport: the six variants,
the server's decision rules, the virtual clock, the runtime and error theory, AdaSync's K,
staleness compensation and the delayed Nesterov outer optimizer. See docs/method.md."""
