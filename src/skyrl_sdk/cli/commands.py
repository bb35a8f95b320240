"""The ``skyrl-sdk`` command: inspect plugins and losses, run the demo, serve over HTTP.

Every listing has a ``--json`` form that prints exactly one JSON document on stdout (logs
and warnings go to stderr), so scripts and tests can read it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import SkyrlError, did_you_mean, install_hint
from ..version import __version__
from .output import print_json, print_table

logger = logging.getLogger(__name__)

DESCRIPTION = "skyrl-sdk: train Hugging Face causal LMs behind Tinker's API, in-process or over HTTP."
EPILOG = "Start with: skyrl-sdk demo. Each command has its own --help."


# ---- plugins ------------------------------------------------------------------------------


def plugin_rows() -> list[dict[str, Any]]:
    """One dict per plugin, loaded or failed, in load order."""
    from ..builtin_plugins import get_plugins

    return [info.to_dict() for info in get_plugins().plugins]


def cmd_plugins(args: argparse.Namespace) -> int:
    rows = plugin_rows()
    if args.json:
        print_json(rows)
        return 0
    print_table(
        ("NAME", "PACKAGE", "VERSION", "BUILTIN", "REGISTERED"),
        [
            (
                r["name"], r["package"], r["version"], "yes" if r["builtin"] else "no",
                f"ERROR: {r['error']}" if r["error"] else (", ".join(r["registered"]) or "-"),
            )
            for r in rows
        ],
    )
    return 0


# ---- version ------------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cmd_version(args: argparse.Namespace) -> int:
    if not args.json:
        print(f"skyrl-sdk {__version__}")
        return 0
    deps = ("torch", "transformers", "pluggy", "attrs", "tinker")
    print_json({
        "skyrl_sdk": __version__,
        "python": sys.version.split()[0],
        **{d: _dist_version(d) for d in deps},
    })
    return 0


# ---- demo / serve (written elsewhere, imported only when used) ----------------------------


def _lazy(module: str, func: str, hint: str) -> Callable[[argparse.Namespace], int]:
    """A handler that imports ``module`` on use, so listing plugins never pulls in a server."""

    def handler(args: argparse.Namespace) -> int:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            why = "not in this installation" if (exc.name or "").startswith("skyrl_sdk") else hint
            print(f"skyrl-sdk {args.command}: cannot import {exc.name!r} ({why})", file=sys.stderr)
            return 2
        result = getattr(mod, func)(args)
        return int(result or 0)

    return handler


def _command(sub: Any, common: argparse.ArgumentParser, name: str, summary: str, **kwargs: Any
             ) -> argparse.ArgumentParser:
    """A subcommand whose one-line summary is both its entry in ``skyrl-sdk --help`` and the
    first line of its own ``--help``."""
    parser = sub.add_parser(name, parents=[common], help=summary, description=summary[0].upper() + summary[1:] + ".",
                            **kwargs)
    parser.summary = summary
    return parser


def _add_threads(p: argparse.ArgumentParser) -> None:
    from .threads import positive_int

    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads for torch (default: $OMP_NUM_THREADS if set, else 1: more threads "
                        "stall when other jobs share the cores)")


def _add_demo(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _command(sub, common, "demo", ("train the tiny model to reverse digit strings: SFT, then RL "
                                        "(about 10 s on an idle CPU, slower on a loaded one)"))
    p.add_argument("--steps", type=int, default=120, help="supervised steps (default 120)")
    p.add_argument("--rl-steps", type=int, default=16, help="RL steps after SFT (default 16)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON document")
    p.add_argument("--out", default="./skyrl-demo-out", help="output directory (default ./skyrl-demo-out)")
    p.add_argument("--short", action="store_true", help="a tiny run (for tests)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    _add_threads(p)
    p.set_defaults(func=_lazy("skyrl_sdk.cli.demo", "main", "skyrl-sdk doctor says what is missing"))


SERVE_EPILOG = """\
Point the tinker client at it:
  export TINKER_BASE_URL=http://127.0.0.1:8000   # or ServiceClient(base_url="http://127.0.0.1:8000")
  export TINKER_API_KEY=tml-anything             # the client insists on a key starting with "tml-",
                                                 # even when the server checks none (no --api-key)
Models, engine, sampler and their configs are checked before the server binds; a problem exits with
status 2 and the reason. See docs/server.md.
"""


def _add_serve(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _command(sub, common, "serve", "serve models over Tinker's HTTP API for the tinker client and the cookbook",
                 epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from ..server.settings import add_flags  # the server's settings, declared once (no server import)

    add_flags(p)
    p.add_argument("--lazy", action="store_true",
                   help="check models and engine config without loading the weights at start "
                        "(big models: they load when a client first asks)")
    _add_threads(p)
    p.set_defaults(func=_lazy("skyrl_sdk.cli.serve", "serve", install_hint("server")))


class CliParser(argparse.ArgumentParser):
    """The top-level parser; :func:`build_parser` gives it each command's own parser."""

    #: name -> the command's own parser (see parse_args)
    commands: Mapping[str, argparse.ArgumentParser]
    #: a command's parser: its one-line summary (its entry in ``skyrl-sdk --help``)
    summary: str = ""


def build_parser() -> CliParser:
    # -v is accepted before or after the subcommand; SUPPRESS keeps a later default from
    # overwriting an earlier -v.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="more logging (-v info, -vv debug)")
    parser = CliParser(prog="skyrl-sdk", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    parser.add_argument("--version", action="version", version=f"skyrl-sdk {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = _command(sub, common, "plugins", "list installed plugins and what each registered")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_plugins)

    p = _command(sub, common, "losses", "list losses: the names each dialect calls them, inputs, config defaults")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--dialect", default=None, help="show only the names of this dialect")
    p.add_argument("--wide", action="store_true", help="one line per loss (a wide table) instead of wrapped blocks")
    p.set_defaults(func=_lazy("skyrl_sdk.cli.losses", "cmd_losses", "skyrl-sdk doctor says what is missing"))

    p = _command(sub, common, "version", "print the version (with --json, also key dependencies)")
    p.add_argument("--json", action="store_true", help="also the versions of key dependencies, as JSON")
    p.set_defaults(func=cmd_version)

    from .doctor import add_parser as add_doctor

    add_doctor(sub, common, _command)
    _add_demo(sub, common)
    _add_serve(sub, common)
    parser.commands = sub.choices
    return parser


def parse_args(parser: CliParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that an unknown option after a command is reported with
    that command's usage (argparse would show the top-level one), naming a close option."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        own = parser.commands.get(args.command, parser)
        options = [o for action in own._actions for o in action.option_strings]
        typo = next((e for e in extra if e.startswith("-")), "")
        own.error(f"unrecognized arguments: {' '.join(extra)}{did_you_mean(typo.split('=')[0], options)}")
    return args


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def _silence_broken_pipe() -> int:
    """``skyrl-sdk losses | head``: the reader left; exit quietly instead of a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
    return 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.command is None:  # bare `skyrl-sdk`: show what there is to do
        parser.print_help()
        return 0
    _setup_logging(args.verbose)
    try:
        code = args.func(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _silence_broken_pipe()
    except SkyrlError as exc:
        print(f"skyrl-sdk: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


