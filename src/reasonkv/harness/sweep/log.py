"""The results file, and what each record says about where it was made.

The driver alone writes the file: each line with one os.write on an O_APPEND descriptor,
then fsync, under an exclusive flock (a second sweep on the same file is refused). On
open, a trailing line without its newline (a write cut by kill -9) is cut off the file; a
unit whose key has a line is done. Error lines (status "error") count as done too, unless
retry_errors is set; the report prefers a unit's "ok" line.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import os
import platform
import subprocess
from collections.abc import Iterable
from pathlib import Path

import torch

from reasonkv.harness.sweep.grid import GridError


def _parse_lines(data: bytes) -> tuple[list[dict], int]:
    """Complete lines of a results file as records, and how many were unreadable."""
    records, bad = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("key"), str):
            records.append(record)
        else:
            bad += 1
    return records, bad


def read_results(path: str | Path) -> tuple[list[dict], int]:
    """Records of a results file (read only: a trailing partial line is ignored, not removed)
    and the count of lines that could not be read (partial tail included)."""
    data = Path(path).read_bytes()
    cut = data.rfind(b"\n") + 1
    records, bad = _parse_lines(data[:cut])
    return records, bad + (1 if data[cut:].strip() else 0)


class ResultsLog:
    """The sweep's append-only JSONL, opened for one writer.

    Opening takes an exclusive flock (released by the kernel even on kill -9), cuts off a
    trailing partial line, and reads every record. `append` writes one whole line per
    os.write on the O_APPEND descriptor and fsyncs it before returning: once append has
    returned, the unit is on disk; before, at most a partial tail exists, cut off next time.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise GridError(f"{self.path} is in use by another sweep (it holds the file's lock)") from None
        data = b""
        while chunk := os.pread(self.fd, 1 << 20, len(data)):
            data += chunk
        cut = data.rfind(b"\n") + 1
        self.dropped_tail = len(data) - cut  # bytes of an interrupted write, now removed
        if self.dropped_tail:
            os.ftruncate(self.fd, cut)
            os.fsync(self.fd)
        self.records, self.unreadable = _parse_lines(data[:cut])

    def append(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        size = os.fstat(self.fd).st_size
        try:
            written = os.write(self.fd, data)
            while written < len(data):  # a regular file takes it all at once; a full disk may not
                written += os.write(self.fd, data[written:])
            os.fsync(self.fd)
        except OSError:
            with contextlib.suppress(OSError):  # no half line for the next record to follow
                os.ftruncate(self.fd, size)
            raise
        self.records.append(record)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1

    def __enter__(self) -> ResultsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def done_keys(records: Iterable[dict], retry_errors: bool = False) -> set[str]:
    """Keys of finished units: those with an ok line, and those with an error line unless
    errors are to be retried."""
    return {r["key"] for r in records if r.get("status") == "ok" or not retry_errors}


def versions() -> dict[str, str | None]:
    """The library versions a record was made with (reasonkv's from its installed metadata)."""
    import transformers

    try:
        ours: str | None = importlib.metadata.version("reasonkv")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        ours = None
    return {
        "reasonkv": ours,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def git_info() -> dict | None:
    """The commit of the reasonkv source tree (and whether tracked files differ), or None."""
    root = Path(__file__).resolve().parents[2]  # the reasonkv package folder
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}
