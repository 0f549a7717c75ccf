"""What the package's command lines share: a bad argument is one `error:` line and exit status 2,
and --help gives each option's default.

    parser = ArgumentParser(prog="python -m llama_xla_helpers.train")
    ...
    with user_errors(debug=args.debug):  # a ValueError / FileNotFoundError from checking input
        run(args)                         # becomes `error: <message>`, exit 2; --debug: the traceback
"""
import argparse
import contextlib
import sys


def fail(message):
    """Print `error: message` on stderr and exit with status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def shown_default(value):
    """A default as a user types it: (4, 2) -> "4,2", 30.0 -> "30.0"."""
    return ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


class HelpFormatter(argparse.HelpFormatter):
    """Every help line ends with its option's default, "(default: 64)", unless the line already
    says it ("default" in the text, for a default that needs words: "default: $LLAMA_XLA_API_KEY"),
    or there is none to show: None (the help says what leaving it out does) or a flag (off unless given)."""

    def _get_help_string(self, action):
        help, default = action.help, action.default
        if any(default is v for v in (None, False, argparse.SUPPRESS)) or "default" in help.lower():
            return help
        return f"{help} (default: {shown_default(default).replace('%', '%%')})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument prints one line (no usage block) and exits 2, and
    --help shows each option's default (HelpFormatter; subcommands' parsers get it too)."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message):
        fail(f"{message} (see {self.prog} --help)")


@contextlib.contextmanager
def user_errors(debug=False):
    """Turn the errors the package raises for bad input into one `error:` line and exit 2.

    Such errors are raised before any work (checks of arguments, files, shapes); anything
    else is a bug and keeps its traceback. `debug=True` keeps the traceback for these too.
    """
    try:
        yield
    except (ValueError, FileNotFoundError) as e:
        if debug:
            raise
        fail(str(e))


def int_list(example):
    """An argparse type: "4,2" -> (4, 2); `example` shows the form in the error."""
    def parse(text):
        try:
            return tuple(int(k) for k in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a list of ints like {example}") from None
    return parse


def add_compile_cache_args(parser):
    """--compile-cache DIR and --compile-cache-readonly, for `runtime.init_runtime(cache_dir, cache_readonly)`."""
    parser.add_argument("--compile-cache", metavar="DIR", help="keep compiled programs in DIR across restarts "
                                                            "(default: $LLAMA_XLA_COMPILE_CACHE, if set)")
    parser.add_argument("--compile-cache-readonly", action="store_true", help="read --compile-cache, write nothing")
