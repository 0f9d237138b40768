"""Settings declared once. Each service's settings are one typed class (pydantic-settings): a field's
name, type, default, bounds and description make its flag (``--max-sessions``), bind its environment
variable (``SPECMESH_MAX_SESSIONS``: how Kubernetes manifests set it) and write its row of the flags
tables in docs/operations.md; the launcher writes its services' command lines from the same fields.
A flag given wins over its variable, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from typing import Annotated, Any, ClassVar, Iterable, Literal, Self, Sequence

from pydantic import Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from specmesh.errors import InvalidArgument

ENV_PREFIX = "SPECMESH_"


def setting(default: Any, description: str, *, shown: str | None = None, **bounds: Any) -> Any:
    """A field: ``description`` is its help and docs text, ``shown`` its default as people should read it
    (where the value itself, e.g. None, says nothing), ``bounds`` pydantic's (``ge``, ``gt``, ...)."""
    return Field(default, description=description, json_schema_extra={"shown": shown} if shown else None, **bounds)


def default_of(settings: type[BaseSettings], name: str) -> Any:
    """The default of ``settings``' field ``name``, for the machinery it configures: a default is stated once,
    where its flag is declared."""
    return settings.model_fields[name].default


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _base_type(annotation: Any) -> Any:
    """``int | None`` -> ``int``: the type a flag's text is read as."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else str
    return annotation


def _shown_default(info: FieldInfo) -> str:
    extra = info.json_schema_extra or {}
    if "shown" in extra:
        return extra["shown"]
    default = info.default
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"`{default}`" if isinstance(default, str) and default else ("empty" if default == "" else str(default))


class Settings(BaseSettings):
    """A service's settings: subclasses declare fields with ``setting``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True, validate_default=True,
                                      protected_namespaces=())
    renamed: ClassVar[dict[str, str]] = {}  # an old setting's name -> its new one

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser, names: Iterable[str] | None = None, *,
                  defaults: bool = False, environment: bool = True) -> None:
        """Add the flags of fields ``names`` (default: all). ``defaults``: each flag defaults to its field's
        default (a command that uses the values itself); else an absent flag is None (the field's variable
        or default decides; a launcher passes on only what was given)."""
        for name in names if names is not None else cls.model_fields:
            info = cls.model_fields[name]
            help_text = info.description or ""
            help_text += f" (default: {_shown_default(info).strip('`')})"
            if environment:
                help_text += f" [{env_name(name)}]"
            options: dict[str, Any] = {"help": help_text.replace("%", "%%"), "dest": name,
                                       "default": info.default if defaults else None}
            kind = _base_type(info.annotation)
            if typing.get_origin(kind) is Literal:
                options["choices"] = typing.get_args(kind)
            elif kind is bool:
                options["action"] = argparse.BooleanOptionalAction
            elif kind in (int, float):
                options["type"] = _reader(name, info)
            parser.add_argument(flag_name(name), **options)

    @classmethod
    def parser(cls, prog: str, description: str) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=prog, description=description,
                                         epilog="Each flag's environment variable is in brackets; a flag wins.")
        cls.add_flags(parser)
        return parser

    @classmethod
    def parse(cls, argv: Sequence[str] | None, prog: str, description: str) -> Self:
        """The settings from flags, then ``SPECMESH_*`` variables, then defaults; a bad value exits 2 naming
        its flag and variable."""
        parser = cls.parser(prog, description)
        given = {name: value for name, value in vars(parser.parse_args(argv)).items() if value is not None}
        for old, new in cls.renamed.items():  # an old deployment's variable would otherwise be ignored
            if env_name(old) in os.environ:
                parser.error(f"{env_name(old)} is now {env_name(new)} ({flag_name(new)})")
        try:
            return cls(**given)
        except ValidationError as exc:
            parser.error(_reason(exc))

    @classmethod
    def checked(cls, **values: Any) -> dict[str, Any]:
        """``values`` (None: not given) validated as this service's settings would validate them, without
        reading the environment: InvalidArgument naming the first bad one."""
        given = {k: v for k, v in values.items() if v is not None}
        unknown = sorted(set(given) - set(cls.model_fields))
        if unknown:
            raise InvalidArgument(unknown[0], f"not a setting of {cls.__name__}")
        try:
            cls.model_validate({**{k: i.default for k, i in cls.model_fields.items()}, **given})
        except ValidationError as exc:
            error = exc.errors()[0]
            raise InvalidArgument(str(error["loc"][0]), f"{error['msg']}, got {error['input']!r}") from None
        return given

    @classmethod
    def command_line(cls, **values: Any) -> list[str]:
        """The flags that give a service ``values`` (None: left to it), checked as the service checks them."""
        args: list[str] = []
        for name, value in cls.checked(**values).items():
            flag = flag_name(name)
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
            else:
                args += [flag, repr(value) if isinstance(value, float) else str(value)]
        return args

    @classmethod
    def flags_table(cls) -> str:
        """The Markdown table of docs/operations.md: flag, variable, default, description."""
        rows = ["| flag | environment | default | what |", "|---|---|---|---|"]
        for name, info in cls.model_fields.items():
            kind = _base_type(info.annotation)
            what = info.description or ""
            if typing.get_origin(kind) is Literal:
                what += " (" + ", ".join(f"`{c}`" for c in typing.get_args(kind)) + ")"
            rows.append(f"| `{flag_name(name)}` | `{env_name(name)}` | {_shown_default(info)} | "
                        f"{what.replace('|', '&#124;')} |")
        return "\n".join(rows) + "\n"


def _reader(name: str, info: FieldInfo):
    """A flag's text as its field reads it, bounds checked: argparse says which flag and why."""
    adapter = TypeAdapter(Annotated[_base_type(info.annotation), *info.metadata])

    def read(text: str):
        try:
            return adapter.validate_python(text)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(f"{exc.errors()[0]['msg']}, got {text!r}") from None

    read.__name__ = name  # argparse names the type in its message
    return read


def _reason(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        where = f"{flag_name(name)} ({env_name(name)})" if name else "settings"
        parts.append(f"{where}: {error['msg']}, got {error['input']!r}")
    return "; ".join(parts)
