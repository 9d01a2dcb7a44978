"""attnserve loadtest [run|sweep] --scenario NAME --users N[,N...] --duration 30s [--host URL] [--rate R]

Thin entry point: the work is in loadtests/cli.py, which runs Locust in its own process."""

from loadtests.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
