"""`attnserve` subcommands, one module each (service/cli.py runs them)."""

import contextlib


class CommandError(Exception):
    """A command that cannot go on: service/cli.py prints `attnserve <command>: <message>` and exits with
    `code` (2: the arguments or inputs; 1: something the command depends on failed)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


@contextlib.contextmanager
def as_command_error(*errors: type[Exception], code: int = 2):
    """Any of `errors` raised in the block becomes a CommandError with its message."""
    try:
        yield
    except errors as e:
        raise CommandError(str(e), code) from e


def check_decoding_flags(**options) -> dict:
    """The translator's decoding bounds (model/translation.py) for command-line flags, checked before a model
    loads -> the options given (None = not given: the request's default applies)."""
    from model.translation import DecodingOptionError, check_decoding_options

    given = {k: v for k, v in options.items() if v is not None}
    try:
        check_decoding_options({k: f"--{k.replace('_', '-')}" for k in given}, **given)
    except DecodingOptionError as e:
        raise CommandError(str(e)) from None
    return given
