"""Canonical JSON for autopart's data files: writing, strict loading, one-line errors.

Files are written with ``indent=2, sort_keys=True`` and a ``schema_version``;
loaders reject an unknown version, a missing key or a value of the wrong type with
a message naming the file, the key and the command that regenerates it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, ClassVar

from autopart.errors import AutopartError, SchemaError

__all__ = ["JsonFile", "check_writable", "dump_json", "write_text"]

SCHEMA_VERSION = 1


class JsonFile:
    """Mixin for frozen dataclasses stored as JSON files (``Profile``, ``Plan``, reports).

    Subclasses set ``_json_what`` (the file kind, for messages), ``_json_remedy`` (the
    command that regenerates the file) and, when theirs differs, ``_json_version``; a
    class whose files of an older version still load maps them with ``_json_upgrade``.
    """

    __slots__ = ()
    _json_what: ClassVar[str] = "autopart"
    _json_remedy: ClassVar[str] = "autopart"
    _json_version: ClassVar[int] = SCHEMA_VERSION

    @classmethod
    def _json_upgrade(cls, data: dict[str, Any], version: Any) -> dict[str, Any] | None:
        """``data`` of an older ``schema_version`` in this version's shape, or ``None``
        when that version cannot be read (the default)."""
        return None

    def to_json(self) -> str:
        """Serialize to JSON text.

        Returns:
            Canonical JSON: sorted keys, indent 2, a trailing newline.

        Raises:
            SchemaError: A value is NaN, which JSON cannot hold.
        """
        return dump_json(_to_plain(self))

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> Any:
        """Parse JSON text written by ``to_json``.

        Args:
            text: The JSON text.
            source: What to call it in error messages (a file name).

        Returns:
            The object, of this class.

        Raises:
            SchemaError: The text is not JSON, has another ``schema_version``, lacks a
                key or holds a value of the wrong type (one line naming ``source``, the
                key and the command that regenerates the file).
        """
        return _from_json_text(cls, text, source, cls._json_what, cls._json_remedy,
                               cls._json_version)

    @classmethod
    def load(cls, path: str | Path) -> Any:
        """Read the JSON file at ``path``.

        Args:
            path: A file written by ``save`` (or the command that writes this kind).

        Returns:
            The object, of this class.

        Raises:
            SchemaError: As ``from_json``, or ``path`` is missing, a directory or
                unreadable.
        """
        return cls.from_json(_read(path, cls._json_what), str(path))

    def save(self, path: str | Path) -> None:
        """Write this object as JSON to ``path``, creating its folder.

        Args:
            path: The file to write.

        Raises:
            AutopartError: The file cannot be written (``SchemaError`` for a NaN value).
        """
        write_text(path, self.to_json())


def check_writable(path: str | Path) -> Path:
    """Make sure an output file can be written there, before any work is done for it.

    Creates the file's folder when it is missing.

    Args:
        path: The output file a user named.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        AutopartError: ``path`` is a directory, its folder cannot be created, or the
            folder or an existing file there is not writable.
    """
    p = Path(path)
    if p.is_dir():
        raise AutopartError(f"cannot write {p}: it is a directory; give a file path")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AutopartError(f"cannot write {p}: cannot create its folder {p.parent} "
                            f"({exc.strerror or exc}); choose a writable path") from None
    if not os.access(p.parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise AutopartError(f"cannot write {p}: permission denied; choose a writable path")
    return p


def write_text(path: str | Path, text: str) -> None:
    """Write a user-named output file, creating its folder.

    Args:
        path: The file to write.
        text: Its content.

    Raises:
        AutopartError: The file cannot be written (one line, with the reason).
    """
    p = check_writable(path)
    try:
        p.write_text(text)
    except OSError as exc:
        raise AutopartError(f"cannot write {p}: {exc.strerror or exc}; choose a writable "
                            f"path") from None


def dump_json(obj: Any) -> str:
    """Canonical JSON text (sorted keys, indent 2, trailing newline) of a dataclass or dict."""
    if dataclasses.is_dataclass(obj):
        obj = _to_plain(obj)
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _parse_object(text: str, source: str, what: str, remedy: str) -> dict[str, Any]:
    """``text`` as a JSON object, or ``SchemaError`` naming ``source`` and the remedy."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{source} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                          f"{remedy}") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{source} holds a JSON {type(data).__name__}, expected a {what} "
                          f"object")
    return data


def _read(path: str | Path, what: str) -> str:
    p = Path(path)
    if p.is_dir():
        raise SchemaError(f"{p} is a directory; give the path of the {what} JSON file")
    if not p.is_file():
        raise SchemaError(f"{what} file {p} does not exist; check the path")
    try:
        return p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SchemaError(f"cannot read {what} file {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SchemaError(f"{p} is not a text file, so not a {what} JSON file; check the "
                          f"path") from None


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, float) and math.isnan(obj):
        raise SchemaError("refusing to write NaN into JSON")
    return obj


def _from_json_text(cls: type, text: str, source: str, what: str, remedy_cmd: str,
                    expected_version: int) -> Any:
    data = _parse_object(text, source, what, f"regenerate it with `{remedy_cmd}`")
    version = data.get("schema_version")
    if version != expected_version:
        older = isinstance(version, int) and not isinstance(version, bool) \
            and 0 < version < expected_version
        upgraded = cls._json_upgrade(dict(data), version) if older else None
        if upgraded is None:
            raise SchemaError(f"{source} has {what} schema_version {version!r}, this autopart "
                              f"reads {expected_version}; regenerate it with `{remedy_cmd}`")
        data = {**upgraded, "schema_version": expected_version}
    return _build(cls, data, source, "", remedy_cmd)


@functools.cache
def _fields_of(cls: type) -> tuple[dict[str, Any], tuple[dataclasses.Field, ...]]:
    """A dataclass's resolved type hints and fields (once per class: a profile has
    thousands of blocks, and resolving the hints per block took most of its load)."""
    return typing.get_type_hints(cls), dataclasses.fields(cls)


def _build(cls: type, data: Any, source: str, where: str, remedy_cmd: str) -> Any:
    if not isinstance(data, dict):
        raise SchemaError(f"{source}: {where or 'top level'} should be an object, "
                          f"got {type(data).__name__}; regenerate it with `{remedy_cmd}`")
    hints, fields = _fields_of(cls)
    kwargs = {}
    for f in fields:
        key = f"{where}.{f.name}" if where else f.name
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(f"{source} is missing key {key!r}; "
                                  f"regenerate it with `{remedy_cmd}`")
            continue
        kwargs[f.name] = _convert(hints[f.name], data[f.name], source, key, remedy_cmd)
    try:
        return cls(**kwargs)
    except (TypeError, SchemaError) as exc:
        raise SchemaError(f"{source}: inconsistent {where or cls.__name__} ({exc}); "
                          f"regenerate it with `{remedy_cmd}`") from None


def _convert(hint: Any, value: Any, source: str, key: str, remedy_cmd: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, source, key, remedy_cmd)
    if origin is dict:
        _, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise SchemaError(f"{source}: key {key!r} should be an object; "
                              f"regenerate it with `{remedy_cmd}`")
        return {k: _convert(value_hint, v, source, f"{key}.{k}", remedy_cmd)
                for k, v in value.items()}
    if origin is tuple:
        (item_hint, *_) = typing.get_args(hint)
        if not isinstance(value, list):
            raise SchemaError(f"{source}: key {key!r} should be a list; "
                              f"regenerate it with `{remedy_cmd}`")
        return tuple(_convert(item_hint, v, source, f"{key}[{i}]", remedy_cmd)
                     for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(inner, value, source, key, remedy_cmd)
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SchemaError(f"{source}: key {key!r} should be a number, got {value!r}; "
                              f"regenerate it with `{remedy_cmd}`")
        return float(value)
    if hint in (int, str, bool) and not isinstance(value, hint):
        raise SchemaError(f"{source}: key {key!r} should be {hint.__name__}, got {value!r}; "
                          f"regenerate it with `{remedy_cmd}`")
    return value
