"""The router's endpoints: v2 (HTTP and gRPC), OpenAI-compatible generation and operator status,
and the request handling behind them (classification, generation, the OpenAPI document)."""
