"""Data preparation and training loops (offline; no serving code)."""
