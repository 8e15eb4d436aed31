"""Command line: ``gpu-topology-agent <subcommand>`` and ``python -m agent``.

Each subcommand lives in ``agent/commands/<name>.py`` and exposes ``add_parser(subparsers)``
(which sets ``func`` on its parser); :data:`COMMAND_MODULES` lists them, in the order
``--help`` shows them. Exit codes: 0 ok, 2 usage or bad
input (one clear line on stderr), 1 anything else.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from agent import __version__
from agent.commands import allocate, demo, discover, doctor, labels, run, slices
from agent.commands._common import friendly_paths
from agent.errors import AgentError

#: The subcommands' modules: each one's name is the subcommand's.
COMMAND_MODULES = (run, discover, allocate, labels, demo, slices, doctor)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse would print usage + exit 2 anyway
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gpu-topology-agent",
        description="Kubernetes GPU node agent: device plugin, labels and metrics, topology-aware.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for module in COMMAND_MODULES:
        module.add_parser(sub)
    return parser


#: Flags whose value may start with "-" followed by a digit (a list such as ``-1,0``):
#: argparse would take it for an option and say only "expected one argument".
_LIST_FLAGS = ("--available", "--must-include")


def _join_list_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if token in _LIST_FLAGS and len(following) > 1 and following[0] == "-" and following[1].isdigit():
            out.append(f"{token}={following}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_join_list_values(list(sys.argv[1:] if argv is None else argv)))
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    try:
        return int(args.func(args) or 0)
    except AgentError as exc:
        message = friendly_paths(str(exc))
        print(f"gpu-topology-agent {args.command}: error: {message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
