"""A job's parameters, defined once: a frozen dataclass whose fields are its command-line flags.

The DAG side builds one and gives its task `to_argv()`; the job side gets the same object back
from `from_argv(sys.argv[1:])`. The argparse parser is generated from the fields, so the two sides
cannot drift apart. A field named `upto_run` is the flag `--upto-run`; its type says how the flag
is read and written:

  str                    the value as given
  int                    a number
  tuple[str, ...]        comma-separated names (`--tables a,b`); empty names are dropped
  Literal["a", "b"]      one of those values (argparse `choices`)
  a pydantic model       its JSON
  X | None               optional: None writes no flag; for a non-str X, "" and "None" read as None

A field without a default is a required flag. `flag(one_of="target")` puts fields in a group of
which a command line gives exactly one (maintenance: --tables, --derived or --feed-output).

A value Airflow fills in at run time (a Jinja template such as "{{ run_id }}") is no value of its
field's type, so it is not held in the object: `to_argv(run_id="{{ run_id }}")` writes it in the
field's place, and the rendered command line parses back into the object's class.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any, ClassVar, Literal, Self, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel


def flag(default: Any = MISSING, *, help: str, one_of: str | None = None) -> Any:
    """A field of a job's parameters: its default (none: the flag is required), its --help line, and
    `one_of`, the group of flags of which a command line gives exactly one."""
    return field(default=default, metadata={"help": help, "one_of": one_of})


@dataclass(frozen=True)
class _Codec:
    """How one field's flag is read (parse: argparse `type`) and written (show)."""

    parse: Callable[[str], Any]
    show: Callable[[Any], str]
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None


def _names(text: str) -> tuple[str, ...]:
    return tuple(n for n in text.split(",") if n)


def _optional(codec: _Codec) -> _Codec:
    """X | None for a non-str X: "" and "None" (what Jinja renders of an absent value) read as None."""
    return replace(codec, parse=lambda s: None if s.strip() in ("", "None") else codec.parse(s))


_PLAIN = {str: _Codec(str, str), int: _Codec(int, str, metavar="N")}
_NAMES = _Codec(_names, ",".join, metavar="NAME[,NAME...]")


def _codec(hint: Any) -> _Codec:
    args = get_args(hint)
    if get_origin(hint) in (Union, types.UnionType):  # X | None
        (inner,) = [a for a in args if a is not type(None)]
        return _codec(inner) if inner is str else _optional(_codec(inner))
    if get_origin(hint) is tuple and args == (str, ...):
        return _NAMES
    if get_origin(hint) is Literal:
        return _Codec(str, str, choices=args)
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return _Codec(hint.model_validate_json, lambda m: m.model_dump_json(), metavar="JSON")
    if hint in _PLAIN:
        return _PLAIN[hint]
    raise TypeError(f"a job parameter cannot be of type {hint!r}: see cdc_lakehouse.jobs.params")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_set(value: Any) -> bool:
    return value is not None and value != ()


@dataclass(frozen=True, kw_only=True)
class JobParams:
    """Base of every job's parameters: the flags every job takes. A subclass is a frozen kw_only
    dataclass whose `description` is its --help's first line."""

    description: ClassVar[str] = ""

    config_dir: str | None = flag(
        None, help="directory of the table YAML files (default: $CDC_TABLES_DIR, else include/tables)"
    )
    app_name: str | None = flag(None, help="the Spark application's name (default: cdc-<job>-<names>)")

    def __post_init__(self) -> None:
        groups: dict[str, list[str]] = {}
        for f in fields(self):
            if f.metadata.get("one_of"):
                groups.setdefault(f.metadata["one_of"], []).append(f.name)
        for names in groups.values():
            given = [n for n in names if _is_set(getattr(self, n))]
            if len(given) != 1:
                raise ValueError(f"{type(self).__name__}: give exactly one of {names}, not {given or 'none'}")

    @classmethod
    def _fields(cls) -> list[tuple[Field[Any], _Codec]]:
        """The fields in flag order: the job's own first, then the ones every job has."""
        hints = get_type_hints(cls)
        common = {f.name for f in fields(JobParams)}
        ordered = sorted(fields(cls), key=lambda f: f.name in common)
        return [(f, _codec(hints[f.name])) for f in ordered]

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(description=cls.description)
        groups: dict[str, Any] = {}
        for f, codec in cls._fields():
            one_of = f.metadata.get("one_of")
            if one_of and one_of not in groups:
                groups[one_of] = p.add_mutually_exclusive_group(required=True)
            target = groups[one_of] if one_of else p
            required = f.default is MISSING  # flag() gives a default or none, never a factory
            target.add_argument(
                _flag(f.name),
                dest=f.name,
                type=codec.parse,
                choices=codec.choices,
                metavar=codec.metavar,
                required=required,
                default=None if required else f.default,
                help=f.metadata.get("help"),
            )
        return p

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> Self:
        """The parameters a command line gives (None: this process's, sys.argv[1:]); a bad one
        exits with argparse's usage message, as any command line does."""
        p = cls.parser()
        ns = p.parse_args(argv)
        try:
            return cls(**vars(ns))
        except ValueError as exc:
            p.error(str(exc))

    def to_argv(self, **templates: str) -> list[str]:
        """The command line that parses back into these parameters: a flag per field that has a
        value, in field order. `templates`: per field name, the text Airflow renders at run time,
        written in the field's place (its value here is not used)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(templates) - known)
        if unknown:
            raise ValueError(f"{type(self).__name__} has no field {unknown}; its fields: {sorted(known)}")
        argv: list[str] = []
        for f, codec in self._fields():
            value = getattr(self, f.name)
            if f.name in templates:
                argv += [_flag(f.name), templates[f.name]]
            elif _is_set(value):
                argv += [_flag(f.name), codec.show(value)]
        return argv
