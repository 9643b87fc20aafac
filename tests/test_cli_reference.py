"""Every flag documented where users look: each command's ``--help`` describes the command and
every option (with its unit and default), and docs/CLI.md is generated from the same parser."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent import cli_args
from agent.cli import build_parser
from agent.cli_reference import commands, options, render

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.worker, pytest.mark.timeout(60)]

NUMERIC_TYPES = {
    int, float, cli_args.positive_int, cli_args.non_negative_int, cli_args.positive_float,
    cli_args.non_negative_float, cli_args.probability, cli_args.unit_interval,
}  # fmt: skip
#: what a number may count or measure, said in its flag name (a unit suffix) or its description
UNIT_SUFFIXES = ("-s", "-ms", "-bytes", "-per-day", "-per-minute", "-mbit")
UNIT_WORDS = re.compile(
    r"\b(seconds?|ms|bytes|MiB|tokens?|threads?|positions?|sequences?|rows?|steps?|blocks?|layers?|"
    r"nodes?|ranges?|requests?|groups?|checks?|attempts?|share|chance|mass|temperature|seed|"
    r"difference|error|noise|sessions?|count|RMS|percent|machines?|keys?|hours?)\b"
)


def _all_commands() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    return list(commands(build_parser()))


def test_docs_cli_md_is_generated_from_the_parser() -> None:
    assert (REPO / "docs" / "CLI.md").read_text() == render(), (
        "docs/CLI.md is stale: python -m agent.cli_reference > docs/CLI.md"
    )


@pytest.mark.parametrize("path", [" ".join(p) for p, _ in _all_commands()])
def test_every_command_says_what_it_does(path: str) -> None:
    parser = dict((" ".join(p), c) for p, c in _all_commands())[path]
    assert parser.description, f"{path} --help has no description"


def test_every_option_has_help_and_names_its_default_and_unit() -> None:
    problems = []
    for path, parser in _all_commands():
        for action in options(parser):
            flag = f"{' '.join(path)} {action.option_strings[0] if action.option_strings else action.dest}"
            text = action.help or ""
            if not text.strip():
                problems.append(f"{flag}: no help")
                continue
            # (a switch's default is its absence: --no-channel's True says nothing to a user)
            has_default = action.default not in (None, [], argparse.SUPPRESS) and not isinstance(action.default, bool)
            if has_default and action.option_strings and "default" not in text:
                problems.append(f"{flag}: default {action.default!r} not in its help")
            numeric = action.type in NUMERIC_TYPES or (
                isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
            )
            if numeric and action.option_strings:
                named = action.option_strings[0].endswith(UNIT_SUFFIXES)
                if not named and not UNIT_WORDS.search(f"{action.option_strings[0]} {text}"):
                    problems.append(f"{flag}: a number with no unit in its name or help")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("argv", [["--help"], ["tracker", "serve", "--help"], ["relay", "keys", "add", "--help"]])
def test_help_runs_as_users_run_it(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", *argv], capture_output=True, text=True, timeout=30, check=False, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: baton")
    assert "default" in done.stdout or argv == ["--help"]
