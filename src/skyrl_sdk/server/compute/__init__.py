"""The compute layer: served models and the work on them (the runtime routes call, the compute
thread, jobs in order, sessions, sampling, saves, exports, the catalog)."""
