"""What the conformance tier asks of the agent still exists, checked without the Kubernetes
binaries: the tier skips wherever ``GPU_AGENT_K8S_BINARIES`` is unset, and a renamed flag,
config key or spec key must fail here rather than only where the binaries are.

Every case's agent command line parses with the agent's own parser, its machine loads and its
configuration loads as ``run`` would load it; the same for the command lines of the two-agent
tests and of ``discover``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dmharness_cases import AGENT, CASES, _command
from test_conformance_defects import _agent_argv

from agent.cli import build_parser
from agent.commands.run import FLAG_FIELDS
from agent.config import load_config
from agent.hw.sim.machines import load_spec


def _parse(argv: list[str]):
    assert argv[0] == str(AGENT)
    return build_parser().parse_args(argv[1:])


def _check_run(argv: list[str], cwd: Path) -> None:
    args = _parse(argv)
    assert args.command == "run"
    machine = args.simulate if Path(args.simulate).is_absolute() or not (cwd / args.simulate).exists() else str(cwd / args.simulate)
    load_spec(machine)
    config_file = args.config if args.config is None or Path(args.config).is_absolute() else str(cwd / args.config)
    load_config(config_file, {}, {name: getattr(args, name) for name in FLAG_FIELDS})


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_cases_agent_command_line_machine_and_config_are_accepted(case, tmp_path):
    command, cwd = _command(CASES[case], str(tmp_path))
    agent = [part.replace("{DIR}", str(tmp_path / "d")) for part in command[command.index("--") + 1:]]
    _check_run(agent, Path(cwd or tmp_path))


def test_the_two_agent_and_discover_command_lines_are_accepted(tmp_path):
    # the command lines themselves, not subprocess.Popen patched: the harness runs in the
    # background of this process start their own subprocesses meanwhile
    for argv in (_agent_argv(str(tmp_path)),
                 _agent_argv(str(tmp_path), "--socket-name", "other-{resource}.sock", "--feature-file", "other-agent")):
        _check_run(argv, tmp_path)
    args = _parse([str(AGENT), "discover", "--simulate", "dgx-h100", "--format", "json"])
    assert (args.command, args.format) == ("discover", "json")
