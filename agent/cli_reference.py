"""The command-line reference (docs/CLI.md), generated from the parser that ``baton`` itself uses.

Owns: walking ``agent.cli.build_parser()`` (every command and sub-command, in the order
``baton --help`` lists them) and rendering each one's description and options as markdown.
The parser is the single source of every flag's name, argument, unit and default: ``--help``
and the docs read the same strings, and tests/test_cli_reference.py checks that docs/CLI.md is
what this module renders now.

    python -m agent.cli_reference > docs/CLI.md
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

__all__ = ["commands", "options", "render"]

HEADER = """\
# Command-line reference

Every `baton` command and its options, generated from the parser that `baton` itself uses
(`python -m agent.cli_reference > docs/CLI.md`; a test checks that this page is current).
`baton COMMAND [SUBCOMMAND] --help` prints the same text. Units are in the option's name
(`-s`, `-ms`, `-bytes`) or its description; so is each default.
"""


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("baton",)
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """``(command path, parser)`` for ``parser`` and every sub-command below it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options and positional arguments of one command (not -h, not its sub-commands)."""
    return [
        a for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS
    ]  # fmt: skip


def _argument(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return str(action.metavar or (action.dest.upper() if action.option_strings else action.dest))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """docs/CLI.md's text."""
    if parser is None:
        from agent.cli import build_parser

        parser = build_parser()
    out = [HEADER]
    for path, command in commands(parser):
        rows = options(command)
        subs = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        out += [f"## {' '.join(path)}", ""]
        if command.description:
            out += [_cell(command.description.split("\n\n")[0]), ""]
        if subs:
            out += ["| sub-command | what it does |", "|---|---|"]
            out += [f"| `{' '.join(path)} {c.dest}` | {_cell(c.help or '')} |" for c in subs[0]._choices_actions]
            out.append("")
        if rows:
            out += ["| option | argument | what it does |", "|---|---|---|"]
            for a in rows:
                name = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}` (positional)"
                if a.required:
                    name += " (required)"
                argument = _argument(a)
                out.append(f"| {name} | {'`' + argument + '`' if argument else ''} | {_cell(a.help or '')} |")
            out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
