"""``python -m qwen3_rl``: one command table; every entry resolves to a function, help lists each once."""

from __future__ import annotations

import importlib

import pytest

from qwen3_rl.__main__ import COMMANDS, main


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_resolves_to_a_callable(name):
    module, func = COMMANDS[name].target.split(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_help_lists_every_command_once(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [ln.split()[0] for ln in out.splitlines() if ln.startswith("  ")]
    assert listed == list(COMMANDS)


def test_unknown_command_is_one_error_and_exit_2(capsys):
    assert main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err


def test_command_gets_the_remaining_arguments(capsys):
    """The dispatch passes argv after the command name: ``pins --format json`` prints the pins as JSON."""
    assert main(["pins", "--format", "json"]) == 0
    assert capsys.readouterr().out.lstrip().startswith("{")
