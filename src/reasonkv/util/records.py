"""JSON records in and out: atomic writes, the creation timestamp, rows picked by id."""

from __future__ import annotations

import json
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
