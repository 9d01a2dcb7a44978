"""`attnserve` subcommands, one module each (service/cli.py runs them)."""


class CommandError(Exception):
    """A command that cannot go on: service/cli.py prints `attnserve <command>: <message>` and exits with
    `code` (2: the arguments or inputs; 1: something the command depends on failed)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
