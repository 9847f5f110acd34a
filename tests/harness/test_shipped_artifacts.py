"""What the repository ships as text (docs/, examples/, the README) is clean UTF-8.

A U+FFFD (the replacement character) in a shipped page means a token's bytes were decoded on
their own: docs/analyze-example/index.html once showed `\\(6x = s\\) �<mark>�</mark>` long after
the code was fixed, because the page was never regenerated. Regenerate it with the command in
its summary.json (`command`).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT = {".html", ".json", ".jsonl", ".md", ".txt", ".log", ".toml", ".csv", ".svg"}


def shipped_text_files() -> list[Path]:
    files = [p for top in ("docs", "examples") for p in (ROOT / top).rglob("*") if p.suffix in TEXT]
    return sorted([ROOT / "README.md", *files])


def test_the_shipped_files_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in shipped_text_files()}
    assert {"README.md", "docs/analyze-example/index.html", "docs/analyze-example/summary.json"} <= names


def replacement_characters(path: Path) -> str | None:
    """Where the file holds U+FFFD, with the text around it; None when it holds none."""
    text = path.read_bytes().decode("utf-8")  # strict: invalid UTF-8 fails here
    at = text.find("\ufffd")
    return None if at < 0 else f"character {at}: …{text[max(0, at - 60) : at + 20]!r}…"


def test_no_shipped_file_holds_a_replacement_character() -> None:
    found = {p.relative_to(ROOT).as_posix(): replacement_characters(p) for p in shipped_text_files()}
    bad = {name: where for name, where in found.items() if where is not None}
    listed = "\n".join(f"{name} {where}" for name, where in bad.items())
    assert not bad, f"U+FFFD in shipped files (regenerate them):\n{listed}"


def test_the_check_catches_the_old_mojibake(tmp_path) -> None:
    page = tmp_path / "index.html"
    page.write_text("<code>(x\\): \\(6x = s\\) \ufffd<mark>\ufffd</mark></code>", encoding="utf-8")
    assert replacement_characters(page) is not None
    page.write_text("<code>\\(6x = s\\) <mark>⇒</mark></code>", encoding="utf-8")
    assert replacement_characters(page) is None
