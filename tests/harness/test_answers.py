"""Final-answer extraction (last \\boxed{}) and math-verify judging, on a table of tricky cases."""

from __future__ import annotations

import importlib.util
import threading

import pytest

from reasonkv.harness.answers import extract_boxed, is_correct, normalise

NEEDS_MATH_VERIFY = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None,
    reason="math-verify is not installed: only its symbolic grading finds these equal",
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so the answer is $\boxed{5}$.", "5"),
        (r"nested: \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"deeper \boxed{\frac{\sqrt{3}}{2^{x+1}}} done", r"\frac{\sqrt{3}}{2^{x+1}}"),
        (r"first \boxed{3} then corrected \boxed{4}", "4"),
        (r"\fbox{7} is framed", "7"),
        (r"$\boxed 9$", "9"),
        (r"\boxed 12.", "12"),
        (r"spaces \boxed {6}", "6"),
        (r"escaped braces \boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"interval \boxed{[2, 5)}", "[2, 5)"),
        (r"text \boxed{5\text{ cm}}", r"5\text{ cm}"),
        ("no box here, the answer is 5", None),
        ("", None),
        (r"cut off: \boxed{3} and later \boxed{\frac{1", "3"),  # an unclosed box does not count
        (r"\boxed{\frac{1", None),
        (r"\boxedfoo{3} is another macro", None),
    ],
)
def test_extract_boxed_takes_the_last_complete_box(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        (r"\frac{1}{2}", r"\frac{1}{2}", True),
        pytest.param(r"\dfrac{1}{2}", r"\frac12", True, marks=NEEDS_MATH_VERIFY),
        pytest.param("0.5", r"\frac{1}{2}", True, marks=NEEDS_MATH_VERIFY),
        pytest.param(r"5\text{ cm}", "5", True, marks=NEEDS_MATH_VERIFY),
        (r"90^\circ", "90", True),
        ("90", r"90^\circ", True),
        pytest.param(r"2\sqrt{3}", r"\sqrt{12}", True, marks=NEEDS_MATH_VERIFY),
        (r"50\%", "50", True),
        ("-3", "-3", True),
        ("-3", "3", False),
        ("1,000", "1000", True),
        ("1000", "1{,}000", True),
        pytest.param(r"$\frac{3}{4}$", "0.75", True, marks=NEEDS_MATH_VERIFY),
        ("$7$", "7", True),
        ("[2,5)", "[2, 5)", True),
        ("(2,5)", "[2,5)", False),  # open vs half-open interval
        (r"(-\infty, 3]", r"(-\infty,3]", True),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})", True),
        pytest.param(r"\text{(C)}", "C", True, marks=NEEDS_MATH_VERIFY),
        (r"\text{Evelyn}", r"\text{Evelyn}", True),
        ("7", "8", False),
        (r"\frac{1}{3}", "0.33", False),
        (None, "5", False),
        ("", "5", False),
    ],
)
def test_is_correct_judges_equivalence(prediction: str | None, gold: str, expected: bool) -> None:
    assert is_correct(prediction, gold) is expected


def test_boxed_completion_end_to_end() -> None:
    text = r"First \boxed{3}? No: $x = \dfrac{6}{4}$ so the answer is $\boxed{\dfrac{3}{2}}$."
    assert is_correct(extract_boxed(text), r"\frac{3}{2}")
    assert not is_correct(extract_boxed(text), "3")


def test_is_correct_never_raises_on_garbage() -> None:
    for junk in (r"\frac{", "}}}{{{", r"\boxed{", "\\" * 50, "x" * 2000, r"\sqrt[", "1/0"):
        assert is_correct(junk, "5") is False


@NEEDS_MATH_VERIFY
def test_is_correct_works_outside_the_main_thread() -> None:
    # math-verify's signal-based timeout would fail off the main thread (e.g. in a Ray worker).
    results: list[bool] = []
    thread = threading.Thread(
        target=lambda: results.extend([is_correct("0.5", r"\frac12"), is_correct("2", "3")])
    )
    thread.start()
    thread.join()
    assert results == [True, False]


def test_is_correct_falls_back_to_strings_without_math_verify(monkeypatch) -> None:
    import reasonkv.harness.answers as answers

    monkeypatch.setattr(answers, "_math_verify", lambda pred, gold: None)
    assert is_correct(r"\dfrac{1}{2}", r"\frac{1}{2}")
    assert is_correct(r"1,000\text{ cm}", "1000 cm")
    assert not is_correct("0.5", r"\frac{1}{2}")  # needs math-verify


def test_normalise_strips_presentation_only() -> None:
    assert normalise(r"$\left( 1,\! 2 \right)$") == "(1,2)"
    assert normalise(r"12{,}345.") == "12345"
    assert normalise(r"45^{\circ}") == "45"
