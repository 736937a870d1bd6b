"""Saved runs: the state of a run and its DCP files (state), the checkpointer that decides when to
save and keeps the last N (manager), the strict reader of what a checkpoint holds (reader), and
what its state.json may hold (schema). Imports distributed/, files/ and the package's top.
"""
