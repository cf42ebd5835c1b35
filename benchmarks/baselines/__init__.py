"""The setups ours is compared with: ORT in-process, a naive FastAPI server, plain Ray Serve."""
