"""Reliability scripts run against a throwaway Ray Serve deployment on tiny models: overload shedding,
mid-stream disconnects and replica crashes. Figures and commands: docs/reliability.md."""
