"""The state layer: what survives a restart (the state dir's lock, SQLite records, checkpoint
directories, metrics history, session search). Below the compute layer, above the wire."""
