"""HTTP servers: the feature server (online lookups, push, materialize) and the inference server."""
