"""The router: HTTP ingress (a thin shell) and its policies (plain classes, no Ray).

Here, one replica's shell: the deployment (`ingress`), its HTTP app (`http`), the parts it is
made of (`parts`), its process setup (`startup`), background loops (`background`) and metrics
(`telemetry`, `telemetry_lifecycle`). Beside them, by concern:
- `edge/`: pure ASGI ahead of FastAPI: the first checks, v2 infer's one way in, the direct path;
- `endpoints/`: v2 (HTTP and gRPC), OpenAI-compatible and status endpoints, and the request
  handling behind them (classification, generation);
- `admission/`: who is calling, a request's priority and deadline, the router's overload gate;
- `routing/`: the names served, versions and tiers, the per-model dispatchers, replica states.
"""
