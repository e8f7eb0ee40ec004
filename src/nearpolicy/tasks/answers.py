"""Pull the final answer out of a model's response text.

Only the response is ever passed in, never the prompt, so an answer that appears in the prompt
cannot be credited to the model (invariant 12).
"""

from __future__ import annotations

import re

__all__ = ["extract_final_answer", "last_boxed"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "Answer: X", "answer: X", "**Answer:** X", "Final answer: X" (the rest of that line).
_ANSWER_COLON = re.compile(r"(?im)\banswer\s*\**\s*[:：]\s*\**[ \t]*(.*)$")
# "The answer is X", "the final answer is X", "answer is: X".
_ANSWER_IS = re.compile(r"(?i)\banswer\s+is\s*:?\s*\**[ \t]*(.*)")
# Thousands-grouped numbers first, then plain integers / decimals. A minus sign counts only when it
# is not a binary minus (not right after a word character or a closing bracket).
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?(?<![\d.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)"
)
_SENTENCE_END = re.compile(r"\.(?:\s|$)")


def _balanced_body(text: str, start: int) -> str | None:
    """Text from ``start`` to the brace closing the one just before it; None if unclosed."""
    depth = 1
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            i += 2  # skip escaped characters such as \{ and \}
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Contents of the last closed ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (nested braces
    balanced), or None if there is none."""
    for match in reversed(list(_BOXED.finditer(text))):
        body = _balanced_body(text, match.end())
        if body is not None:
            return body
    return None


def _clean(answer: str | None) -> str | None:
    """Strip whitespace, wrapping ``$`` / ``**`` and a trailing ``.``; None if nothing is left."""
    if answer is None:
        return None
    previous = None
    while answer != previous:
        previous = answer
        answer = answer.strip()
        if answer.endswith("."):
            answer = answer[:-1]
        for wrapper in ("**", "$"):
            if answer.startswith(wrapper):
                answer = answer[len(wrapper):]
            if answer.endswith(wrapper):
                answer = answer[: -len(wrapper)]
    return answer or None


def _last_nonempty(matches: list[re.Match[str]], *, cut_sentence: bool) -> str | None:
    for match in reversed(matches):
        value = match.group(1)
        if cut_sentence:
            end = _SENTENCE_END.search(value)
            if end is not None:
                value = value[: end.start()]
        value = _clean(value)
        if value is not None:
            return value
    return None


def extract_final_answer(response: str) -> str | None:
    """The final answer stated in ``response``, or None if it states none.

    Priority: the last ``\\boxed{}`` / ``\\fbox{}``; the last ``Answer: X`` line; the last
    "the (final) answer is X"; the last number (integer, negative or decimal; thousands commas
    removed). The result is stripped of whitespace, surrounding ``$`` / ``**`` and a trailing ``.``.
    Never raises for any string.
    """
    boxed = _clean(last_boxed(response))
    if boxed is not None:
        return boxed
    for pattern, cut in ((_ANSWER_COLON, False), (_ANSWER_IS, True)):
        found = _last_nonempty(list(pattern.finditer(response)), cut_sentence=cut)
        if found is not None:
            return found
    numbers = _NUMBER.findall(response)
    if numbers:
        return numbers[-1].replace(",", "")
    return None
