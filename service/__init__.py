"""attnserve serving: engines (no Ray), HTTP API, Ray Serve deployments, CLI."""
