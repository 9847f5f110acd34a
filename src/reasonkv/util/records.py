"""JSON records in and out: atomic writes, the creation timestamp, rows picked by id, and
reading JSON and JSON-lines input with errors that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path


def write_json_atomic(record: object, path: str | Path, *, indent: int | None = None) -> Path:
    """Write `record` as JSON through a temporary file, so an interrupted run never leaves
    half a file (the parent folder is made if needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=indent))
    tmp.replace(path)
    return path


def write_jsonl_atomic(rows: list[object], path: str | Path) -> Path:
    """Write `rows` as JSON lines (one object per line, UTF-8 kept) through a temporary file,
    like write_json_atomic."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    tmp.replace(path)
    return path


def utc_timestamp() -> str:
    """Now, as every saved record spells it: ISO 8601 in UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def pick_by_id(rows: list[dict], ids: list[str], what: str, source: object) -> list[dict]:
    """The rows with these ids, in the order of `ids`; an id that no row has is a ValueError
    ("{what} ids not in {source}: ...")."""
    by_id = {r["id"]: r for r in rows}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise ValueError(f"{what} ids not in {source}: {', '.join(unknown)}")
    return [by_id[i] for i in ids]


# ------------------------------------------------------------------ reading input files
class RecordError(ValueError):
    """Bad content in an input file, in one sentence that names where: "path:line: what is
    wrong" (or "path: ..." for the whole file). A ValueError, so every command reports it as
    a one-line error with exit code 2."""


def describe_json(value: object) -> str:
    """What a JSON value is, for messages: 'null', 'a number', 'a string', 'a list', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def not_utf8(text: str) -> str | None:
    """Why `text` cannot be encoded as UTF-8 (a lone surrogate: an undecodable byte that
    Python kept from the command line, or a "\\udcff" escape in JSON), or None if it can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        return f"not UTF-8 text ({what} at character {err.start + 1})"
    return None


def _read_bytes_lines(path: Path):
    try:
        with path.open("rb") as f:
            yield from f
    except FileNotFoundError:
        raise
    except OSError as err:
        raise RecordError(f"{path}: cannot read it ({err.strerror or err})") from None


def _decode(raw: bytes, where: str, first: bool) -> str:
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as err:
        raise RecordError(
            f"{where}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}; a binary file?)"
        ) from None


def _not_json(where: str, err: json.JSONDecodeError, ends_early: bool) -> RecordError:
    hint = "; the file ends there, truncated?" if ends_early else ""
    return RecordError(f"{where}: not JSON ({err.msg.removesuffix(' at')} at column {err.colno}{hint})")


def read_jsonl_objects(path: str | Path, what: str = "row") -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of a JSON-lines file, in order. A line
    that is not UTF-8, not JSON, or JSON but not an object ({...}) is a RecordError naming the
    file and line, e.g. "traces.jsonl:2: not JSON (Expecting ',' delimiter at column 201)"."""
    path = Path(path)
    for n, raw in enumerate(_read_bytes_lines(path), 1):
        where = f"{path}:{n}"
        line = _decode(raw, where, n == 1)
        if not line.strip():
            continue
        try:
            obj = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as err:
            raise _not_json(where, err, ends_early=False) from None
        if not isinstance(obj, dict):
            got = describe_json(obj)
            raise RecordError(f"{where}: each {what} must be a JSON object ({{...}}), got {got}")
        yield n, obj


def read_json_object(path: str | Path, what: str = "file") -> dict:
    """The JSON object ({...}) a file holds; a file that cannot be read, is not UTF-8, not JSON
    (truncated, binary) or another JSON value is a RecordError naming it (and the line)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as err:
        raise RecordError(f"{path}: cannot read it ({err.strerror or err})") from None
    text = _decode(raw, str(path), True)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise _not_json(f"{path}:{err.lineno}", err, ends_early=err.pos >= len(text.rstrip())) from None
    if not isinstance(obj, dict):
        raise RecordError(f"{path}: a {what} must be a JSON object ({{...}}), got {describe_json(obj)}")
    return obj
