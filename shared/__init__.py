"""Code used by both processes: the wire protocol, configuration, errors and paths."""
