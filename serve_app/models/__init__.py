"""Model deployments: one Ray Serve deployment class per model family, no HTTP."""
