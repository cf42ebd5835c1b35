"""Whether and how the router takes a request: who is calling (keys, rate limits), its priority
and deadline, and the router's own overload gate. Plain classes, no Ray."""
