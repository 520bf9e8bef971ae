"""HTTP face: OpenAI-compatible FastAPI ingress on Ray Serve."""
