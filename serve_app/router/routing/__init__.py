"""Where a request goes: the names the router serves, the versions and tiers that answer them,
the per-model dispatchers, and what Serve's controller says of the deployments."""
