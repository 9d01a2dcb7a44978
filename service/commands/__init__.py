"""`attnserve` subcommands, one module each (service/cli.py runs them)."""

import contextlib


class CommandError(Exception):
    """A command that cannot go on: service/cli.py prints `attnserve <command>: <message>` and exits with
    `code` (2: the arguments or inputs; 1: something the command depends on failed)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


@contextlib.contextmanager
def as_command_error(*errors: type[Exception]):
    """Any of `errors` raised in the block becomes a CommandError (exit 2) with its message."""
    try:
        yield
    except errors as e:
        raise CommandError(str(e)) from e


def check_at_least_one(**flags: int | None) -> None:
    """Each flag given (not None; `avg_last` is --avg-last) is >= 1, else a CommandError naming it."""
    for name, value in flags.items():
        if value is not None and value < 1:
            raise CommandError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def check_decoding_flags(**options) -> dict:
    """The translator's decoding bounds (model/translation.py) for command-line flags, checked before a model
    loads -> the options given (None = not given: the request's default applies)."""
    from model.translation import DecodingOptionError, check_decoding_options

    given = {k: v for k, v in options.items() if v is not None}
    with as_command_error(DecodingOptionError):
        check_decoding_options({k: f"--{k.replace('_', '-')}" for k in given}, **given)
    return given
