"""One error path for every command-line entry point (`spice`, tools/*.py).

An error the user can fix is one `error: ...` line on stderr naming the file, tensor or field and
what would fix it, and exit code 2, with no traceback (`-v`/`--verbose` or `SPICE_DEBUG=1` shows
it). Every such error is a `UserError`; the package's own error classes (ConfigError, PlanError,
CorpusError, CheckpointError, ...) derive from it, which is why this module sits below all of them
and imports nothing of the package.

Under torchrun only one line reaches the user: a rank that finds the error writes it to the file
named by SPICE_ERROR_FILE (set by `spice_megatron.torchrun` when it relaunches a command under
torchrun) and exits 2; the launcher prints the line once, after every rank has stopped, without
torchrun's own traceback. Under a launcher of the user's own (srun, torchrun), each rank prints
it, rank 0's line unmarked.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Callable, NoReturn

USER_ERROR_EXIT = 2
ERROR_FILE_ENV = "SPICE_ERROR_FILE"


class UserError(Exception):
    """Bad input the user can fix; the message names the file, tensor or field and the fix."""


class ConfigError(UserError, ValueError):
    """A config value is invalid; the message starts with the dotted field name."""


def require(ok: bool, name: str, msg: str) -> None:
    """ConfigError naming `name` unless `ok`."""
    if not ok:
        raise ConfigError(f"{name}: {msg}")


class HelpFormatter(argparse.HelpFormatter):
    """`--help` lists an option by its one current spelling (an older one, given after it, is still
    accepted but not listed) and says its default."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if len(longs) > 1:
            import copy

            action = copy.copy(action)
            action.option_strings = [s for s in action.option_strings if not s.startswith("--")] + longs[:1]
        return super()._format_action_invocation(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" not in text and action.default not in (None, False, "", [], argparse.SUPPRESS)
                and (action.option_strings or action.nargs in ("?", "*"))):
            text += " (default: %(default)s)"
        return text


class Spelled(argparse.Action):
    """Stores the value and the spelling the user typed (`<dest>_flag`), so that an error names the
    option as it was written (--out, or today's --output)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_flag", option_string)


def typed_flag(args: argparse.Namespace, dest: str) -> str:
    """The spelling of option `dest` on the command line (its current one when it was not given)."""
    return getattr(args, f"{dest}_flag", None) or "--" + dest.replace("_", "-")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's error line: usage first, then `error: PROG: ...` last, exit 2;
    `--help` shows defaults and each option's current spelling (HelpFormatter)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        if kwargs.get("help") is None and kwargs.get("default") not in (None, False, "", []):
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        import re

        self.print_usage(sys.stderr)
        choice = re.match(r"argument .*: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:  # argparse (before Python 3.14) names the choices, not the near one
            message += did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)) or
                                    [c.strip() for c in choice.group(2).split(",")]).replace(",", ":", 1)
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)


def did_you_mean(given: str, known) -> str:
    """", did you mean X?" for the one close match of `given` among `known` (difflib), or ""."""
    import difflib

    close = difflib.get_close_matches(given, list(known), n=1, cutoff=0.6)
    return f", did you mean {close[0]}?" if close else ""


def positive_int(value: str) -> int:
    """An argparse type: an integer >= 1 (argparse names the flag and the value when it is not)."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return n


def non_negative_int(value: str) -> int:
    """An argparse type: an integer >= 0 (0: not set)."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return n


def debugging(argv: list[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return os.environ.get("SPICE_DEBUG", "") not in ("", "0") or "-v" in argv or "--verbose" in argv


def error_line(e: BaseException) -> str:
    """The one line: the message's first line, its spacing collapsed."""
    msg = str(e)
    return "error: " + " ".join(msg.split("\n")[0].split()) if msg else f"error: {type(e).__name__}"


def read_json(path: str, what: str = "") -> dict:
    """A JSON object from a user's file, or one UserError naming the file and what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file{what}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    return obj


def require_dir(path: str, flag: str, what: str = "") -> None:
    """A directory the user named with `flag` must exist."""
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path}: no such directory{what}")


def report_user_error(e: BaseException) -> None:
    """Print (or, under the relaunching launcher, record) the error line once per job."""
    line = error_line(e)
    path = os.environ.get(ERROR_FILE_ENV)
    if path:  # the launcher prints the first rank's line after all ranks have stopped
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as f:
            f.write(line + "\n")
        return
    # a launcher of the user's own: rank 0's line as is; another rank may have found what rank 0
    # did not, so it says so too, marked with its rank
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    print(line if rank == "0" else f"[rank {rank}] {line}", file=sys.stderr)


def call_entry_point(main: Callable[[], int | None], argv: list[str] | None = None) -> int:
    """main()'s exit code, with every UserError as one line and exit code 2."""
    try:
        return main() or 0
    except UserError as e:
        if debugging(argv):
            traceback.print_exc()
        report_user_error(e)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def run_entry_point(main: Callable[[], int | None], argv: list[str] | None = None) -> NoReturn:
    """A tool's `if __name__ == "__main__":` line."""
    code = call_entry_point(main, argv)
    sys.stdout.flush()
    sys.exit(code)
