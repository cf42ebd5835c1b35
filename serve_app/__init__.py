"""A multi-model inference serving cluster on Ray Serve."""

__version__ = "0.1.0"
