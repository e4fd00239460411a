"""Engines: the server core (rules, state, records) and how it meets learners, on a virtual
clock (`simulated`) or across processes (`distributed`)."""
