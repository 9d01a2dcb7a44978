"""The `attnserve` command line. Each subcommand lives in `service/commands/<name>.py` and exposes
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their command runs."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {
    "weights": "fetch and convert model weights (weights fetch smollm2)",
    "generate": "stream a completion from SmolLM2 (or --model DIR), without Ray",
    "data": "prepare datasets (data prepare translate)",
    "train": "train a model (train translate --config configs/translate.json)",
    "translate": "translate text with the local translator, without Ray",
    "eval": "evaluate a model (eval translate)",
    "serve": "start Ray + Serve locally in the foreground",
    "stop": "stop a local Serve/Ray instance",
    "deploy": "deploy the Serve config to a running Ray cluster",
    "cluster": "start/stop a local multi-node Ray cluster (cluster up|down)",
    "loadtest": "run Locust load tests against the service",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="attnserve", description=__doc__.split(".")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        print(f"attnserve: unknown command {argv[0]!r}; one of: {', '.join(COMMANDS)} (attnserve --help)",
              file=sys.stderr)
        return 2
    name = argv[0]
    from model.cpu_features import apply_isa_cap

    try:
        apply_isa_cap()  # before any command imports torch
    except ValueError as e:
        print(f"attnserve: {e}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"service.commands.{name}")
    except ModuleNotFoundError as e:
        print(f"attnserve {name}: not available in this build ({e})", file=sys.stderr)
        return 2
    from service.commands import CommandError

    cmd = argparse.ArgumentParser(prog=f"attnserve {name}", description=COMMANDS[name])
    module.add_arguments(cmd)
    args = cmd.parse_args(argv[1:])
    try:
        rc = int(module.run(args) or 0)
        sys.stdout.flush()  # a pipe that closed fails here, inside the handlers, not at exit
        return rc
    except CommandError as e:
        print(f"attnserve {name}: {e}", file=sys.stderr, flush=True)
        return e.code
    except KeyboardInterrupt:  # Ctrl-C: no traceback, the shell's exit status for SIGINT
        print(f"\nattnserve {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush cannot fail again
        return 141  # 128 + SIGPIPE, the shell's status for a writer whose pipe closed


if __name__ == "__main__":
    sys.exit(main())
