"""Load tests (Locust scenarios, CLI, plots) and benchmarks for attnserve."""
