"""The server core across processes: the server loop, the learner's side and their transport."""
