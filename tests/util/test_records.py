"""Reading JSON and JSON-lines input: every bad file is one sentence that names the file and line."""

from __future__ import annotations

import json

import pytest

from reasonkv.util.records import RecordError, read_json_object, read_jsonl_objects

GOOD = json.dumps({"id": "a", "problem": "p", "trace": "t"})


def test_jsonl_yields_line_numbers_and_skips_blank_lines(tmp_path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\n\n  \r\n" + GOOD.encode() + b"\r\n")
    assert [n for n, _ in read_jsonl_objects(path)] == [1, 4]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("null", "rows.jsonl:2: each row must be a JSON object ({...}), got null"),
        ("3", "rows.jsonl:2: each row must be a JSON object ({...}), got a number"),
        ('"x"', "rows.jsonl:2: each row must be a JSON object ({...}), got a string"),
        ("[1, 2]", "rows.jsonl:2: each row must be a JSON object ({...}), got a list"),
        ("true", "got true/false"),
        (GOOD[:-2], "rows.jsonl:2: not JSON (Unterminated string starting at column"),
        ('{"id": 1,, }', "rows.jsonl:2: not JSON (Expecting property name"),
    ],
)
def test_a_bad_jsonl_line_names_the_file_and_its_line(tmp_path, line, message) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(GOOD + "\n" + line + "\n")
    with pytest.raises(RecordError) as err:
        list(read_jsonl_objects(path))
    assert message in str(err.value) and str(err.value).startswith(str(path))
    assert "line 1 column" not in str(err.value) and "\n" not in str(err.value)


def test_jsonl_that_is_not_utf8_or_not_a_file_is_a_record_error(tmp_path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"id": "\xff"}\n')
    with pytest.raises(RecordError, match=r"rows\.jsonl:2: not UTF-8 text \(byte 0xff"):
        list(read_jsonl_objects(path))
    with pytest.raises(RecordError, match="cannot read it"):
        list(read_jsonl_objects(tmp_path))
    with pytest.raises(FileNotFoundError):  # the caller says what it looked for
        list(read_jsonl_objects(tmp_path / "missing.jsonl"))
    assert issubclass(RecordError, ValueError)  # the CLI's one-line error, exit 2


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"3", "p.json: a profile must be a JSON object ({...}), got a number"),
        (b"null", "p.json: a profile must be a JSON object ({...}), got null"),
        (b'{"demand": [1, 2', "p.json:1: not JSON (Expecting ',' delimiter at column 17; the file ends"),
        (b'{\n "a": 1\n "b": 2}', "p.json:3: not JSON (Expecting ',' delimiter at column 2)"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "p.json: not UTF-8 text (byte 0x89 at offset 0; a binary file?)"),
        (b"", "p.json:1: not JSON (Expecting value at column 1; the file ends there, truncated?)"),
    ],
)
def test_a_bad_json_file_names_the_file(tmp_path, data, message) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(data)
    with pytest.raises(RecordError) as err:
        read_json_object(path, "profile")
    assert message in str(err.value) and str(err.value).startswith(str(path))


def test_a_json_object_is_read(tmp_path) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"demand": [1.0, 2.5]}')
    assert read_json_object(path) == {"demand": [1.0, 2.5]}
