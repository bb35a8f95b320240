"""The wire layer: what crosses it, as values (request bodies, Tinker's JSON envelopes and protobuf
answers, ``tinker://`` paths, metadata caps, the client's routes). Imports nothing above it."""
