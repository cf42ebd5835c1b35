"""Tuning of the process a replica runs in: threads' CPU priority, the garbage collector's pauses,
the C heap's free pages. No Ray."""
