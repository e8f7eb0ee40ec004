"""The chat template a run lays its prompts out with (model.chat_template), installed on the tokenizer so that
model/load.chat_prompt_ids (tokenizer.apply_chat_template) and the tool-message framing (tools/protocol.py) use it.

- "auto": the model's own template, unchanged; a model without one is refused.
- "gemma": Gemma's turn format,
  `<bos><start_of_turn>user\\n{system}\\n\\n{user}<end_of_turn>\\n<start_of_turn>model\\n`.
  Gemma has no system role: the system message is folded into the first user turn (a blank line between them); an
  assistant message is a `model` turn, any other role (user, tool) a `user` turn. Written here from the format.
- "plain": no markers: the system message, a blank line, then each other message followed by a newline; BOS first
  when the tokenizer puts one before plain text (Gemma does, SmolLM2 does not).
- a path to a .jinja file: that Jinja chat template.

The tokenizer renders and then tokenizes without adding special tokens, so a template's own BOS is the only one;
`use_chat_template` checks that the result starts with at most one BOS, and for "gemma" that the turn markers are
single tokens of the vocabulary.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATES = ("auto", "gemma", "plain")  # besides a path to a .jinja file (config/schema.py ModelConfig agrees)

_GEMMA_MARKERS = ("<start_of_turn>", "<end_of_turn>")
GEMMA_TEMPLATE = (
    r"{{- bos_token -}}"
    r"{%- set ns = namespace(system='') -%}"
    r"{%- for message in messages -%}"
    r"{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\n\n' -%}"
    r"{%- elif message['role'] == 'assistant' -%}"
    r"{{- '<start_of_turn>model\n' + message['content'] + '<end_of_turn>\n' -}}"
    r"{%- else -%}"
    r"{{- '<start_of_turn>user\n' + ns.system + message['content'] + '<end_of_turn>\n' -}}"
    r"{%- set ns.system = '' -%}"
    r"{%- endif -%}"
    r"{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)
_PLAIN_BODY = (
    r"{%- for message in messages -%}"
    r"{{- message['content'] + ('\n\n' if message['role'] == 'system' else '\n') -}}"
    r"{%- endfor -%}"
)


def describe_choices() -> str:
    """The model.chat_template choices in words (for errors)."""
    return f"one of {', '.join(repr(c) for c in CHAT_TEMPLATES)} or a path to a .jinja file"


def plain_template(bos: bool) -> str:
    """The "plain" template; `bos`: start with the tokenizer's BOS."""
    return (r"{{- bos_token -}}" if bos else "") + _PLAIN_BODY


def adds_bos(tokenizer) -> bool:
    """Whether `tokenizer` puts its BOS before a plain text (its own post-processing, however it is declared)."""
    bos = tokenizer.bos_token_id
    return bos is not None and list(tokenizer("x")["input_ids"])[:1] == [bos]


def chat_template_source(tokenizer, choice: str) -> str | None:
    """The Jinja text model.chat_template = `choice` installs on `tokenizer` (None for "auto": the model's own is
    kept). Raises ValueError naming model.chat_template for "auto" without a model template, for "gemma" on a
    tokenizer without Gemma's single-token turn markers and BOS, for a choice that is neither a name nor a .jinja
    path; FileNotFoundError when the .jinja file does not exist."""
    if choice == "auto":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"model.chat_template = 'auto' uses the model's own chat template, and this model has "
                             "none; set model.chat_template to 'gemma', 'plain' or a .jinja file")
        return None
    if choice == "gemma":
        for marker in _GEMMA_MARKERS:
            ids = list(tokenizer(marker, add_special_tokens=False)["input_ids"])
            if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
                raise ValueError(f"model.chat_template = 'gemma' needs {marker} as one token; this tokenizer "
                                 f"encodes it as {ids}")
        if tokenizer.bos_token is None:
            raise ValueError("model.chat_template = 'gemma' starts with BOS; this tokenizer has no BOS token")
        return GEMMA_TEMPLATE
    if choice == "plain":
        return plain_template(adds_bos(tokenizer))
    path = Path(choice).expanduser()
    if path.suffix != ".jinja":
        raise ValueError(f"model.chat_template {choice!r} is not {describe_choices()}")
    if not path.is_file():
        raise FileNotFoundError(f"model.chat_template {choice!r} does not exist; {describe_choices()}")
    return path.read_text(encoding="utf-8")


def use_chat_template(tokenizer, choice: str) -> None:
    """Install model.chat_template = `choice` on `tokenizer` (its `chat_template`, which apply_chat_template and
    save_pretrained use); "auto" changes nothing. Then render a system + user prompt with the generation prompt and
    check it: it must render, and start with at most one BOS. Raises what chat_template_source raises, and
    ValueError naming model.chat_template when the template fails to render or doubles BOS."""
    source = chat_template_source(tokenizer, choice)
    previous = tokenizer.chat_template
    if source is not None:
        tokenizer.chat_template = source
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as err:  # noqa: BLE001 - jinja raises TemplateError subclasses, a user template anything
        tokenizer.chat_template = previous
        raise ValueError(f"model.chat_template {choice!r} does not render a system + user prompt: {err}") from None
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    bos = tokenizer.bos_token_id
    if not [i for i in ids if i != bos]:
        tokenizer.chat_template = previous
        raise ValueError(f"model.chat_template {choice!r} renders a system + user prompt as no tokens (beyond BOS)")
    if bos is not None and ids[:2] == [bos, bos]:
        tokenizer.chat_template = previous
        raise ValueError(f"model.chat_template {choice!r} puts BOS before the prompt twice (the template writes it "
                         "and so does the tokenizer); remove the template's BOS")
