"""Final answers: take the last \\boxed{...} of a completion and judge it against the gold answer.

Equivalence is math-verify's (symbolic and numeric: \\frac{1}{2} = 0.5, 2\\sqrt{3} = \\sqrt{12},
units and degree signs dropped, intervals and sets compared as such); a normalised string
comparison runs first (cheap) and stands in when math-verify is missing or fails.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import threading

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced(text: str, start: int) -> str | None:
    """The content of the {...} group opening at text[start], or None when it never closes.
    Escaped braces (\\{ \\}) are content, not structure."""
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def extract_boxed(text: str | None) -> str | None:
    """The content of the last complete \\boxed{...} (or \\fbox{...}, or `\\boxed 5`) in text.

    A box left unclosed (the completion was cut off inside it) is skipped in favour of the
    previous complete one; None when there is no box at all.
    """
    if not text:
        return None
    for match in reversed(list(_BOX.finditer(text))):
        i = match.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            content = _braced(text, i)
            if content is not None:
                return content.strip()
        elif i > match.end():  # `\boxed 5`: the answer runs to the next space or `$`
            content = re.match(r"[^\s$]+", text[i:])
            if content:
                return content.group(0).rstrip(".")
    return None


_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def normalise(answer: str) -> str:
    """A canonical string for cheap equality: no $, spaces, \\left/\\right, \\text{}, degree or
    percent signs, thousands separators or trailing period; \\dfrac/\\tfrac -> \\frac."""
    s = answer.strip().strip("$").strip()
    s = _TEXT.sub(r"\1", s)
    for old, new in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\circ", ""),
        ("°", ""),
        ("\\%", ""),
        ("%", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\$", ""),
        ("{,}", ","),
    ):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s).rstrip(".")
    return _THOUSANDS.sub("", s).lower()


MATH_VERIFY = "math-verify"
STRING_MATCH = "string-match"
FALLBACK_WARNING = (
    "math-verify is not installed: answers are graded by normalised string match only "
    "(\\frac{1}{2} and 0.5 count as different); install the `eval` extra for symbolic grading"
)


def grader() -> str:
    """Which judge `is_correct` uses here: MATH_VERIFY when math-verify can be imported, else
    STRING_MATCH (normalised strings only)."""
    return MATH_VERIFY if importlib.util.find_spec("math_verify") is not None else STRING_MATCH


def _math_verify(prediction: str, gold: str) -> bool | None:
    """math-verify's judgement, or None when it is not installed or cannot parse an answer."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    # Its timeouts use signal.alarm, which works only in the main thread (e.g. not in a Ray
    # worker thread): there it runs without a timeout.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    logger = logging.getLogger("math_verify")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its parse-failure warnings are expected for free-form answers
    try:
        gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=limit)
        pred_parsed = parse(f"\\boxed{{{prediction}}}", parsing_timeout=limit)
        if not gold_parsed or not pred_parsed:
            return None
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=limit))
    except Exception:  # a judge must not crash an evaluation: count it as not proven equal
        return None
    finally:
        logger.setLevel(level)


def is_correct(prediction: str | None, gold: str) -> bool:
    """Whether an extracted answer equals the gold answer (math-verify, string fallback). Never raises."""
    if prediction is None or not str(prediction).strip():
        return False
    try:
        pred, ref = str(prediction).strip().strip("$"), str(gold).strip().strip("$")
        if normalise(pred) == normalise(ref):
            return True
        return bool(_math_verify(pred, ref))
    except Exception:
        return False
