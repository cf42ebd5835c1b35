"""A same-node channel from a router to a model replica for batches (see `client` and `server`)."""
