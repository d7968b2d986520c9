"""The one command-line error path, and settings dataclasses that argparse parsers are built from.

Every command is `main(argv=None) -> int` over keyword-only library functions, its work run by `run_command`:
a `UserError` (bad input, `hf_attn.tooling.errors`) or a file-system error is one line
`hf-attn <command>: error: <what is wrong and what fixes it>` on stderr, exit status 2, nothing written
(outputs are atomic and validated before any work); Ctrl-C and SIGTERM go through the same cleanup; anything
else is a bug and propagates with its traceback. Library functions return results; only commands print.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

from hf_attn.tooling.devices import announcing
from hf_attn.tooling.errors import UserError, one_line, user_message
from hf_attn.tooling.files import sweep_leftovers

INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


def _close_progress_bars() -> None:
    """End open tqdm bars (an exception leaves them mid-line) so the error starts on its own line."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", None) or ()):
        with contextlib.suppress(Exception):
            bar.close()
    with contextlib.suppress(Exception):
        sys.stdout.flush()


def error(prog: str, err: BaseException | str) -> int:
    """Print `prog: error: <one line>` to stderr and return the exit status of a user mistake (2)."""
    _close_progress_bars()
    line = err if isinstance(err, str) else (user_message(err) or one_line(err))
    print(f"{prog}: error: {line}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def sigterm_exits_cleanly() -> Iterator[None]:
    """While inside: SIGTERM (what `kill`, `timeout` and job schedulers send) raises SystemExit(143) in the
    main thread, so `finally` blocks and temporary directories are cleaned up as after Ctrl-C: a terminated
    converter leaves no statistics scratch (gigabytes at 7B) and no half-written output. SIGKILL cannot be
    caught. The previous handler comes back on exit, so a caller's process (a test run, a notebook) keeps its
    own; a process forked meanwhile (a multiprocessing pool worker, which `Pool.terminate` stops with SIGTERM)
    takes the default action at once, as it would without this handler."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return
    owner = os.getpid()

    def terminate(signum: int, frame) -> None:
        if os.getpid() != owner:  # inherited through fork: die now, never unwind someone else's stack
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:  # None: the previous handler was not set from Python; the default action is the best guess
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def run_command(prog: str, fn: Callable[[], Any]) -> int:
    """Sweep what killed processes of this host left, run `fn()` and return its exit status (`fn`'s int, else
    0): 2 with one line on stderr for a UserError or a file-system error, 130 with one line for Ctrl-C;
    SIGTERM exits through the same cleanup (`sigterm_exits_cleanly`); any other error propagates (a bug: its
    traceback, exit status 1)."""
    sweep_leftovers()
    try:
        with sigterm_exits_cleanly(), announcing(prog):  # where it computes: one line (tooling.devices)
            status = fn()
    except (UserError, OSError) as err:
        return error(prog, err)
    except KeyboardInterrupt:
        _close_progress_bars()
        print(f"{prog}: interrupted (Ctrl-C); partial outputs were removed", file=sys.stderr)
        return INTERRUPTED
    return status if isinstance(status, int) and not isinstance(status, bool) else 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help that states every option's default: "(default: X)" after any help that does not say it
    already; on/off flags (store_true / store_false) are off / on unless given, and say nothing more."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        stated = "default" in help_text.lower() or action.default is argparse.SUPPRESS
        if flag or stated or not action.option_strings or action.required:
            return help_text
        default = "none" if action.default is None else "%(default)s"
        return f"{help_text} (default: {default})".lstrip()


class ArgumentParser(argparse.ArgumentParser):
    """argparse with every option's default in --help (`HelpFormatter`) and a usage mistake (an unknown
    option, a missing one, a value of the wrong type) told in one line, exit status 2, as every other
    user mistake."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise SystemExit(error(self.prog, f"{message} (see {self.prog} --help)"))


def parse_with_quick(parser: argparse.ArgumentParser, argv: list[str] | None, quick: dict):
    """`parser`'s arguments; with `--quick`, `quick` are the defaults (options given explicitly still win)."""
    if parser.parse_args(argv).quick:
        parser.set_defaults(**quick)
    return parser.parse_args(argv)


def _field_type(tp) -> tuple[type, bool]:
    """(scalar type, is a list) of a settings field annotation (Optional stripped)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _field_type(args[0])
    if origin in (list, tuple):
        return args[0], True
    return tp, False


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


class _DeprecatedAlias(argparse.Action):
    """A hidden old spelling of a flag: stores into the same field and says which flag replaces it."""

    def __init__(self, option_strings, dest, *, new_flag: str, **kwargs):
        self.new_flag = new_flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new_flag}", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)  # nargs=0: a switch


def add_deprecated_alias(parser, alias: str, *, new_flag: str, dest: str, **kwargs) -> None:
    """A hidden old spelling `alias` of `new_flag` (same dest, type, choices): it still works and warns."""
    kwargs = {**kwargs, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS, "required": False}
    parser.add_argument(alias, dest=dest, action=_DeprecatedAlias, new_flag=new_flag, **kwargs)


def add_settings_arguments(parser: argparse.ArgumentParser, settings: type):
    """One `--flag` per field of the dataclass `settings` (underscores -> dashes), its default, its type and
    the `help` / `choices` / `metavar` / `flag` given in the field's metadata. bool fields with default False
    become store_true flags, with default True `--no-...` flags. A field without a default is a required
    flag. Fields with the same `exclusive` name form a mutually exclusive group; `deprecated_flags` are
    hidden old spellings that keep working (absent from --help, they warn on stderr)."""
    hints = typing.get_type_hints(settings)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        if f.metadata.get("cli") is False:
            continue
        target, group = parser, f.metadata.get("exclusive")
        if group is not None:
            target = groups[group] = groups.get(group) or parser.add_mutually_exclusive_group()
        default = f.default  # MISSING (neither a default nor a factory): a required flag
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help")}
        tp, is_list = _field_type(hints[f.name])
        if tp is bool:
            flag = f.metadata.get("flag", "--no-" + f.name.replace("_", "-")) if default else _flag(f)
            target.add_argument(flag, action="store_false" if default else "store_true", **kwargs)
            continue
        flag = _flag(f)
        kwargs.update(type=tp, **({"nargs": "+"} if is_list else {}))
        kwargs.update({k: f.metadata[k] for k in ("choices", "metavar", "required") if k in f.metadata})
        if default is dataclasses.MISSING:
            kwargs.setdefault("required", True)
        elif not kwargs.get("required"):
            kwargs["default"] = default
        target.add_argument(flag, **kwargs)
        for old in f.metadata.get("deprecated_flags", ()):
            add_deprecated_alias(target, old, new_flag=flag, **kwargs)


def settings_from_args(settings: type, args: argparse.Namespace, **overrides):
    """The dataclass `settings` from parsed arguments (fields the parser lacks keep their defaults)."""
    names = {f.name for f in dataclasses.fields(settings)}
    values = {k: v for k, v in vars(args).items() if k in names}
    return settings(**{**values, **overrides})


def check_choices(settings) -> None:
    """UserError naming the flag, the value and the choices for a field outside its metadata `choices`
    (a None default stays allowed): library callers get the check the parser does."""
    for f in dataclasses.fields(settings):
        choices, value = f.metadata.get("choices"), getattr(settings, f.name)
        if choices is not None and value not in choices and not (value is None and f.default is None):
            raise UserError(f"Unknown {_flag(f)} {value!r}; choose one of {', '.join(map(str, choices))}")


def setting(default=None, help: str | None = None, **metadata):  # noqa: A002
    """A settings field: its default and the metadata `add_settings_arguments` reads (`required=True`: a
    field without a default, a required flag)."""
    metadata = {"help": help, **metadata}
    if metadata.get("required"):
        return dataclasses.field(metadata=metadata)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
