"""Model deployments: one Ray Serve deployment class per model family, no HTTP.

Here the classifiers (`classifier`) and what they answer a handle caller (`prediction`); what
every deployment shares (`base`, `executor`, `health`, `runtime`) and the stand-in for a model
that cannot load (`unavailable`); the generator family, with continuous batching and its KV
cache, in `generation/`.
"""
