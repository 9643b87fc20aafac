"""Config as data: a role's config class is the one place a tunable is named; its flags, its
TOML file keys and its command line are derived from the class.

Owns: ``setting`` (a dataclass field with its flag's help, argument type and spelling),
``add_flags`` (argparse options from a config class), ``settings_from_args`` (the field
values a parsed command line and an optional TOML file give: flags given on the command line
win over the file, the file over the defaults), ``load_toml`` (a file checked key by key
against the class), ``to_argv`` (the flags that rebuild a config: the harness's and the
worker's command lines) and ``flag_names``.

Why stdlib ``dataclasses`` + field metadata + ``argparse`` + ``tomllib``, not pydantic-settings:
the commands are argparse sub-command trees whose help docs/CLI.md is generated from
(``agent.cli_reference``); pydantic-settings' CLI brings its own parser and help layout, and a
dependency, for what is a few dozen lines here. The config classes stay plain frozen
dataclasses that the rest of the code already constructs and ``replace``s.

A field named ``session_idle_timeout_s`` is the flag ``--session-idle-timeout-s`` and the
TOML key ``session_idle_timeout_s``; ``flag=`` spells another flag where an existing command
line must not change (``--key`` for ``key_file``; ``--no-channel`` for ``channel``, a bool
that defaults to True). Fields without ``setting`` metadata (a loaded key, a probe) are
neither flags nor file keys.

Must not import any role: every shell imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "SettingsError",
    "add_flags",
    "flag_names",
    "load_toml",
    "setting",
    "settings_fields",
    "settings_from_args",
    "shared_fields",
    "to_argv",
]

_KEY = "baton_setting"
#: the namespace attribute that lists the dests given on the command line (``_Given``)
_GIVEN = "_settings_given"


class SettingsError(ValueError):
    """A config file (or value) that cannot be used; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class _Meta:
    help: str
    flag: str | None
    metavar: str | None
    parse: Callable[[str], Any] | None
    choices: tuple[str, ...] | None
    required: bool
    command_default: Any


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
    required: bool = False,
    command_default: Any = dataclasses.MISSING,
) -> Any:
    """A config field that is a flag and a TOML key.

    ``parse``: the argparse type (``agent.cli_args``), also applied to file values so that a
    file is checked as the command line is. ``flag``: the flag's spelling when it is not the
    field's name (a bool field that defaults to True must be spelled ``--no-...``).
    ``required``: argparse refuses the command without it (a field that a file may give
    instead is not ``required`` here: the command checks it after merging).
    ``command_default``: the flag's default where the command's differs from the class's (a
    library user opts in to what a command line gets by default).
    """
    meta = _Meta(help, flag, metavar, parse, tuple(choices) if choices else None, required, command_default)
    if isinstance(default, (list, dict, set)):
        raise TypeError("a mutable default: use a tuple")
    return dataclasses.field(default=default, metadata={_KEY: meta})


def _meta(field: dataclasses.Field) -> _Meta | None:
    return field.metadata.get(_KEY)


def settings_fields(cls: type) -> list[tuple[dataclasses.Field, _Meta, Any]]:
    """``(field, its setting, its resolved type)`` for every ``setting`` field of ``cls``."""
    hints = typing.get_type_hints(cls)
    return [(f, m, hints[f.name]) for f in dataclasses.fields(cls) if (m := _meta(f)) is not None]


def _flag(field: dataclasses.Field, meta: _Meta) -> str:
    return meta.flag or "--" + field.name.replace("_", "-")


def _flag_default(field: dataclasses.Field, meta: _Meta) -> Any:
    """What the command line gives a setting it does not name."""
    if meta.command_default is not dataclasses.MISSING:
        return meta.command_default
    return None if field.default is dataclasses.MISSING else field.default


def _optional_inner(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); X -> (X, False)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _is_repeated(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple


class _Given(argparse.Action):
    """Records that its dest was given on the command line (a flag given with the default's
    value still beats a file), then stores as ``kind`` says."""

    def __init__(self, option_strings: list[str], dest: str, kind: str = "store", **kwargs: Any) -> None:
        if kind in ("true", "false"):
            kwargs["nargs"] = 0
        self.kind = kind
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        given = set(getattr(namespace, _GIVEN, ()))
        given.add(self.dest)
        setattr(namespace, _GIVEN, given)
        if self.kind == "true":
            values = True
        elif self.kind == "false":
            values = False
        elif self.kind == "append":
            values = [*(getattr(namespace, self.dest, None) or ()), values]
        setattr(namespace, self.dest, values)


def add_flags(parser: argparse.ArgumentParser, cls: type, *, skip: Sequence[str] = ()) -> None:
    """An argparse option for every ``setting`` field of ``cls`` (``dest``: the field name;
    default: the field's default), in the class's order; ``skip``: field names left out."""
    for field, meta, hint in settings_fields(cls):
        if field.name in skip:
            continue
        inner, _ = _optional_inner(hint)
        default = _flag_default(field, meta)
        options: dict[str, Any] = {"dest": field.name, "help": meta.help, "default": default}
        if meta.required:  # no default to show: the command line must give it
            options.update(required=True, default=None)
        if inner is bool:
            options["kind"] = "false" if default is True else "true"
        else:
            if _is_repeated(inner):
                options["kind"] = "append"
                options["default"] = list(default or ())
            if meta.parse is not None:
                options["type"] = meta.parse
            elif inner in (int, float, Path):
                options["type"] = inner
            if meta.choices:
                options["choices"] = meta.choices
            if meta.metavar:
                options["metavar"] = meta.metavar
        parser.add_argument(_flag(field, meta), action=_Given, **options)


def flag_names(cls: type) -> list[str]:
    """The flags of ``cls``'s settings, in order."""
    return [_flag(field, meta) for field, meta, _ in settings_fields(cls)]


def _file_value(cls: type, key: str, value: Any, hint: Any, meta: _Meta, where: str) -> Any:
    """A TOML value checked against the field's type and flag parser; the field's value."""
    inner, _ = _optional_inner(hint)  # a key present is a value: TOML has no null
    wrong = f"{where}: {key}: "
    if _is_repeated(inner):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise SettingsError(wrong + f"expected a list of strings, got {value!r}")
        return tuple(value)
    if inner is bool:
        if not isinstance(value, bool):
            raise SettingsError(wrong + f"expected true or false, got {value!r}")
        return value
    if inner is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        expected = "an integer"
    elif inner is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        expected = "a number"
    elif inner in (str, Path):
        ok = isinstance(value, str)
        expected = "a string"
    else:  # a field type this module cannot read from a file: a bug in the config class
        raise TypeError(f"{cls.__name__}.{key}: no TOML form for {hint!r}")
    if not ok:
        raise SettingsError(wrong + f"expected {expected}, got {value!r}")
    if meta.choices and value not in meta.choices:
        raise SettingsError(wrong + f"expected one of {', '.join(meta.choices)}, got {value!r}")
    if meta.parse is not None:  # the flag's own checks (ranges, formats), on the same text
        try:
            parsed = meta.parse(str(value))
        except (argparse.ArgumentTypeError, ValueError) as error:
            raise SettingsError(wrong + str(error)) from None
        if not isinstance(parsed, (str, int, float)):  # a parser that builds a richer value
            return parsed
    return Path(value) if inner is Path else float(value) if inner is float else value


def load_toml(path: str | Path, cls: type) -> dict[str, Any]:
    """The field values that the TOML file at ``path`` gives ``cls``'s settings.

    Raises:
      SettingsError: the file cannot be read or is not TOML, or a key is not a setting of
        ``cls`` or has a value of the wrong type or range (the message names file and key).
    """
    where = str(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as error:
        raise SettingsError(f"{where}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise SettingsError(f"{where}: not TOML: {error}") from None
    fields = {field.name: (meta, hint) for field, meta, hint in settings_fields(cls)}
    values = {}
    for key, value in data.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise SettingsError(f"{where}: unknown key {key!r} (the keys are: {known})")
        meta, hint = fields[key]
        values[key] = _file_value(cls, key, value, hint, meta, where)
    return values


def settings_from_args(cls: type, args: argparse.Namespace, file_values: Mapping[str, Any] = {}) -> dict[str, Any]:
    """The values of ``cls``'s settings: a flag given on the command line, else the file's
    value (``load_toml``), else the flag's default (the field's). Keyword arguments for ``cls``."""
    namespace = vars(args)
    given = namespace.get(_GIVEN, set())
    values = {}
    for field, _, hint in settings_fields(cls):
        if field.name not in namespace:
            continue  # left out of this command's flags (``add_flags(skip=...)``)
        value = (
            namespace[field.name] if field.name in given or field.name not in file_values else file_values[field.name]
        )
        if _is_repeated(_optional_inner(hint)[0]) and value is not None:
            value = tuple(value)
        values[field.name] = value
    return values


def to_argv(config: Any, *, skip: Sequence[str] = ()) -> list[str]:
    """The flags that rebuild ``config``'s settings from the command's defaults: every setting
    whose value is not its flag's default (None and empty tuples are never written). What
    ``add_flags`` parses back into an equal config."""
    argv: list[str] = []
    for field, meta, hint in settings_fields(type(config)):
        value = getattr(config, field.name)
        if field.name in skip or value is None or value == () or value == _flag_default(field, meta):
            continue
        inner, _ = _optional_inner(hint)
        flag = _flag(field, meta)
        if inner is bool:
            argv.append(flag)  # a bool differs from its default: the flag flips it
        elif _is_repeated(inner):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]  # str(float) reads back exactly
    return argv


def shared_fields(source: Any, cls: type) -> dict[str, Any]:
    """``source``'s values of the fields ``cls`` has too (the same name, the same meaning): how
    one role's config passes on a part's settings (a node's to its workers, a relay's to its
    swarm client) without naming each, so that a new one is passed on by being declared."""
    names = {f.name for f in dataclasses.fields(cls)} & {f.name for f in dataclasses.fields(source)}
    return {name: getattr(source, name) for name in sorted(names)}
