"""`hexq serve`: an artifact behind an OpenAI-compatible HTTP API (hexq.serve.app), one sequence at a time through
one generation worker (hexq.serve.worker), with Prometheus metrics (hexq.serve.metrics)."""
