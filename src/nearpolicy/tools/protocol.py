"""The tool-call protocol of an episode: how the model asks for a tool, and the token ids the answer comes back as.

A call is JSON between tags, anywhere in the model's turn:

    <tool_call>{"name": "calculator", "arguments": {"expression": "7408 * 3443"}}</tool_call>

(a one-element JSON list of that object is read too: SmolLM2-Instruct's function-calling data writes
`<tool_call>[{...}]</tool_call>`). It is the tag pair SmolLM2's own function-calling format uses and it carries any
MCP tool's name and arguments; SmolLM2-135M copies it exactly from one worked example in the prompt (docs/tools.md
has the measured rates). Only the turn's first call runs. A turn without `<tool_call>` is an answer; one with the
tag but no well-formed call is a malformed call: an error observation the model sees, counted as "malformed".

The tool's answer is inserted as token ids that are never re-tokenised with the transcript (TRL #5224): the chat
template's tool-message framing is rendered ONCE (`ObservationFraming.from_template`: a conversation with a
placeholder tool message, split at the placeholder), its two halves tokenised once, and each observation is
`prefix + tokenize(result text, cut to a length) + suffix`; the suffix ends with the assistant generation prompt,
so the next turn's prompt is the episode's ids so far, verbatim (invariant 19)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.S)
_PLACEHOLDER = "\u2063TOOL-RESULT\u2063"  # invisible separators: no template or tokenizer merges across them
_ASSISTANT = "\u2063ASSISTANT-TURN\u2063"


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's `name` and its `arguments` (a JSON object)."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class MalformedCall:
    """A `<tool_call>` whose content is not a call; `reason` is shown to the model as the error observation."""

    reason: str


def parse_tool_call(text: str) -> ToolCall | MalformedCall | None:
    """The first call in a turn's text: a ToolCall, a MalformedCall (the tag is there, its content is not JSON of
    {"name": str, "arguments": object}, or a one-element list of that), or None (no `<tool_call>` tag: the turn is
    an answer). A missing closing tag at the end of the text, or one cut short ("...}}</tool"), is accepted (a turn
    cut by its token limit)."""
    match = _CALL.search(text)
    if match is None:
        return None
    body = match.group(1).strip()
    if not match.group(0).endswith(CLOSE):  # a turn cut inside its closing tag: drop the part of the tag written
        body = next((body[: -k] for k in range(len(CLOSE) - 1, 0, -1) if body.endswith(CLOSE[:k])), body).rstrip()
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return MalformedCall(f"error: the tool call is not valid JSON: {body[:80]!r}")
    try:  # lone surrogates ("\ud800") decode from JSON but cannot be sent to a server
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return MalformedCall("error: the tool call holds characters that are not valid UTF-8")
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return MalformedCall('error: a tool call is {"name": "<tool>", "arguments": {...}}')
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return MalformedCall('error: the tool call\'s "arguments" must be a JSON object')
    return ToolCall(value["name"], arguments)


@dataclass(frozen=True)
class ObservationFraming:
    """The chat template's tool-message framing as token ids, tokenised once. `prefix` [P]: what follows the
    model's turn before the tool's text (the end of the assistant turn, e.g. SmolLM2's `<|im_end|>` `\\n`, then
    `<|im_start|>tool\\n`); `suffix` [S]: what follows the text (`<|im_end|>\\n<|im_start|>assistant\\n`).
    `max_chars`: the tool's text is cut to this many characters (marked " ...[truncated]")."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    max_chars: int = 400

    @classmethod
    def from_template(cls, tokenizer, max_chars: int = 400) -> "ObservationFraming":
        """Render [system, user, assistant, tool = placeholder] with the generation prompt once and split it: the
        rendering of [system, user, assistant] must be its prefix (a template that rewrites earlier turns when a
        tool message follows cannot frame an observation token-in/token-out). Raises ValueError naming the problem."""
        head = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": _ASSISTANT}]
        before = tokenizer.apply_chat_template(head, tokenize=False)
        after = tokenizer.apply_chat_template(head + [{"role": "tool", "content": _PLACEHOLDER}], tokenize=False,
                                              add_generation_prompt=True)
        if not after.startswith(before) or _PLACEHOLDER not in after[len(before):]:
            raise ValueError("the chat template does not render a tool message after the assistant turn without "
                             "changing the earlier turns: no token-in/token-out framing of tool results")
        end_of_turn = before[before.rindex(_ASSISTANT) + len(_ASSISTANT):]
        header, footer = after[len(before):].split(_PLACEHOLDER)
        if not footer.strip():
            raise ValueError("the chat template's tool message has no closing framing")
        return cls(tuple(_ids(tokenizer, end_of_turn + header, True)), tuple(_ids(tokenizer, footer, True)), max_chars)

    def observation_ids(self, tokenizer, text: str, last_id: int | None) -> list[int]:
        """The ids inserted after a turn whose last sampled id is `last_id` (None: an empty turn): the prefix
        (without its first id when the turn already ended with exactly that id, e.g. `<|im_end|>`: the model sampled
        it; a turn that ended on another stop id, or was cut, gets the whole prefix, so the transcript keeps the
        template), the tool's text cut to max_chars (text that is not valid UTF-8 has its bad characters replaced)
        and tokenised with special tokens split (a tool cannot inject `<|im_end|>`), then the suffix."""
        text = text.encode("utf-8", "replace").decode("utf-8")
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + " ...[truncated]"
        prefix = self.prefix[1:] if self.prefix and last_id is not None and self.prefix[0] == last_id else self.prefix
        return [*prefix, *_ids(tokenizer, text, False), *self.suffix]


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    """Token ids of `text` without BOS; `special`: special-token text (the template's) becomes its token."""
    encoded = tokenizer(text, add_special_tokens=False, split_special_tokens=not special)
    return list(encoded["input_ids"])
