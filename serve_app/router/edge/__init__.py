"""The router's HTTP edge: pure ASGI, ahead of FastAPI. Every request's first checks (API key, body
limit, header-only shedding, trace context), v2 infer's one way in, the direct path from Serve's
HTTP server, and what an unexpected exception at the edge becomes for the client."""
