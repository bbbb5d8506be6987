"""Records to token documents, with the tokens that carry the loss.

A record is one of (the fields TRL's SFT trainer reads):

- ``text``: a string; every token carries the loss, EOS appended (as a text file's).
- ``messages``: a chat, a list of ``{"role", "content"}``, rendered with the tokenizer's
  own chat template; the loss is on the assistant messages' tokens (``--loss-on
  assistant``) or on every token (``--loss-on all``).
- ``prompt`` and ``completion``: two strings (tokenized apart, EOS after the completion)
  or two lists of messages rendered as one chat; the loss is on the completion's tokens.

The assistant tokens of a chat are those the template marks with ``{% generation %}``
blocks, from the tokenizer's own ``return_assistant_tokens_mask``. A template without
them is rendered on prefixes of the conversation instead: an assistant message's span
runs from where its content starts to the end of the conversation rendered up to it,
and the tokens overlapping a span carry the loss (the rule the tokenizer's mask uses).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import LongtrainError
from .records import Record

__all__ = [
    "ASSISTANT",
    "ChatTemplate",
    "Document",
    "assistant_tokens_by_spans",
    "assistant_tokens_by_template",
    "tokenize_record",
]

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' test for a template's assistant marks
ALL, ASSISTANT = "all", "assistant"
# The roles chat templates commonly take; another must be named (quoted) in the template itself.
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


@dataclass
class Document:
    """A document's token ids; ``labelled[i]``: whether token i carries the loss (None: all do)."""

    ids: list[int]
    labelled: list[bool] | None
    structured: bool  # from a chat or prompt/completion record, whose boundaries packing must keep


def tokenize_record(record: Record, tokenizer, loss_on: str = ASSISTANT) -> Document:
    """The document a record holds; a bad record is refused in one line naming it."""
    if isinstance(record.value, str):
        return _text(record.value, tokenizer)
    kind = _kind(record)
    if kind == "text":
        return _text(record.value["text"], tokenizer)
    if kind == "messages":
        return _chat(record, tokenizer, loss_on)
    return _prompt_completion(record, tokenizer, loss_on)


def _kind(record: Record) -> str:
    """Which fields a record trains on: ``messages``, ``prompt``/``completion`` or ``text``
    (a field whose value is null counts as absent: ``datasets`` fills missing ones so)."""
    fields = {k for k, v in record.value.items() if v is not None}
    if "messages" in fields:
        return "messages"
    if fields & {"prompt", "completion"}:
        missing = next((f for f in ("prompt", "completion") if f not in fields), None)
        if missing:
            raise LongtrainError(f"{record.where} has no '{missing}'; a prompt/completion record needs both")
        return "prompt_completion"
    if "text" in fields:
        if not isinstance(record.value["text"], str):
            raise LongtrainError(f"{record.where} has a 'text' of type {type(record.value['text']).__name__}; it must be a string")
        return "text"
    found = ", ".join(repr(f) for f in sorted(fields)) or "none"
    raise LongtrainError(f"{record.where} has no 'text', 'messages' or 'prompt'/'completion' field (its fields: {found}); "
                         "give each record one of them")


def _text(text: str, tokenizer) -> Document:
    ids = tokenizer.encode(text)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return Document(ids, None, structured=False)


def _messages(value, record: Record, field: str) -> list[dict]:
    """``value`` checked as a non-empty list of messages with string role and content,
    null fields dropped (as the tokenizer's own rendering does)."""
    if not isinstance(value, list) or not value:
        raise LongtrainError(f"{record.where}: '{field}' must be a non-empty list of {{'role', 'content'}} messages")
    messages = []
    for number, message in enumerate(value, start=1):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
            raise LongtrainError(f"{record.where}: message {number} of '{field}' needs a string 'role' and a string 'content'")
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


def _chat(record: Record, tokenizer, loss_on: str) -> Document:
    messages = _messages(record.value["messages"], record, "messages")
    template = ChatTemplate(tokenizer, record)
    template.check_roles(messages, "messages")
    if loss_on == ALL:
        return Document(template.tokenize(template.render(messages)), None, structured=True)
    if not any(m["role"] == "assistant" for m in messages):
        raise LongtrainError(f"{record.where} is a chat without an assistant message to put the loss on; "
                             "add one, or pass --loss-on all")
    if template.marks_assistant and template.fast:
        ids, labelled = assistant_tokens_by_template(template, messages)
    else:
        ids, labelled = assistant_tokens_by_spans(template, messages)
    return Document(ids, labelled, structured=True)


def _prompt_completion(record: Record, tokenizer, loss_on: str) -> Document:
    prompt, completion = record.value["prompt"], record.value["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        head, tail = tokenizer.encode(prompt), tokenizer.encode(completion)
        if tokenizer.eos_token_id is not None:
            tail.append(tokenizer.eos_token_id)
        labelled = None if loss_on == ALL else [False] * len(head) + [True] * len(tail)
        return Document(head + tail, labelled, structured=True)
    if not (isinstance(prompt, list) and isinstance(completion, list)):
        raise LongtrainError(f"{record.where}: 'prompt' and 'completion' must both be strings or both lists of messages, "
                             f"got {type(prompt).__name__} and {type(completion).__name__}")
    prompt = _messages(prompt, record, "prompt")
    completion = _messages(completion, record, "completion")
    template = ChatTemplate(tokenizer, record)
    template.check_roles(prompt, "prompt")
    template.check_roles(completion, "completion")
    head, whole = template.render(prompt, generation_prompt=True), template.render(prompt + completion)
    if not whole.startswith(head):
        raise LongtrainError(f"the chat template renders {record.where}'s prompt differently alone and before its completion, "
                             "so the completion's tokens cannot be told apart; pass --loss-on all or use another template")
    if loss_on == ALL:
        return Document(template.tokenize(whole), None, structured=True)
    return Document(*template.tokenize_spans(whole, [(len(head), len(whole))]), structured=True)


class ChatTemplate:
    """A tokenizer's chat template, rendering and tokenizing one record's messages;
    errors name the record."""

    def __init__(self, tokenizer, record: Record):
        self.hf = getattr(tokenizer, "hf", None)  # the Hugging Face tokenizer (None: the byte tokenizer)
        self.record = record
        source = None
        if self.hf is not None:
            try:
                source = self.hf.get_chat_template()
            except ValueError:
                source = None
        if source is None:
            which = "the byte tokenizer" if self.hf is None else f"the tokenizer ({type(self.hf).__name__})"
            raise LongtrainError(f"{record.where} holds chat messages but {which} has no chat template; pass --tokenizer DIR "
                                 "of a tokenizer with one (chat_template.jinja or tokenizer_config.json's chat_template), "
                                 "or give the records as 'text'")
        self.source = source
        self.marks_assistant = bool(GENERATION_BLOCK.search(source))
        self.fast = bool(getattr(self.hf, "is_fast", False))

    def check_roles(self, messages: list[dict], field: str) -> None:
        """Refuse a message whose role is neither a usual one (:data:`ROLES`) nor named in
        the template: a misspelt 'assistant' would train as context, and templates that
        test roles one by one leave an unknown one out of the text without a word."""
        for number, message in enumerate(messages, start=1):
            role = message["role"]
            if role not in ROLES and f"'{role}'" not in self.source and f'"{role}"' not in self.source:
                raise LongtrainError(f"{self.record.where}: message {number} of '{field}' has role {role!r}, which neither "
                                     f"the usual roles ({', '.join(ROLES[:5])}, ...) nor the chat template name; fix the "
                                     "role (the loss goes on 'assistant' messages), or use a template that takes it")

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.apply(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def apply(self, messages: list[dict], **kwargs):
        """``apply_chat_template`` on ``messages``; a refusal of the template names the record."""
        try:
            return self.hf.apply_chat_template(messages, **kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError (raise_exception), TypeError, ValueError...
            reason = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise LongtrainError(f"the chat template refuses {self.record.where} ({reason}); fix the record "
                                 "or pass --tokenizer DIR with a template that takes it") from None

    def tokenize(self, text: str) -> list[int]:
        """Token ids of rendered text (its special tokens read as such, none added)."""
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def tokenize_spans(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
        """Token ids of ``text`` and, per token, whether it overlaps one of the character
        ``spans`` (sorted, disjoint). A tokenizer without character offsets tokenizes
        the text piece by piece, cut at the spans' ends."""
        if not self.fast:
            return self._tokenize_pieces(text, spans)
        encoding = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoding["input_ids"]), overlapping(encoding["offset_mapping"], spans)

    def _tokenize_pieces(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
        ids, labelled, at = [], [], 0
        for start, end in [*spans, (len(text), len(text))]:
            for piece, inside in ((text[at:start], False), (text[start:end], True)):
                if piece:
                    piece_ids = self.tokenize(piece)
                    ids += piece_ids
                    labelled += [inside] * len(piece_ids)
            at = end
        return ids, labelled


def overlapping(offsets, spans: list[tuple[int, int]]) -> list[bool]:
    """Per token (``offsets``: its character start and end), whether it overlaps a span:
    one pass, both being in order."""
    marks, at = [], 0
    for start, end in offsets:
        while at < len(spans) and start >= spans[at][1]:
            at += 1
        marks.append(at < len(spans) and end > spans[at][0])
    return marks


def assistant_tokens_by_template(template: ChatTemplate, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids and assistant marks from the tokenizer's ``return_assistant_tokens_mask``
    (the template's ``{% generation %}`` blocks)."""
    out = template.apply(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def assistant_tokens_by_spans(template: ChatTemplate, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids and assistant marks from the text spans of the assistant messages, found
    by rendering prefixes of the conversation (see :func:`assistant_spans`)."""
    whole = template.render(messages)
    return template.tokenize_spans(whole, assistant_spans(template, messages, whole))


def assistant_spans(template: ChatTemplate, messages: list[dict], whole: str) -> list[tuple[int, int]]:
    """The character span of each assistant message in ``whole`` (the conversation
    rendered): from where its content starts (where two renderings of the conversation up
    to it, differing only in its content, part) to the end of the conversation rendered
    up to it, its end-of-turn text included. A template that renders a prefix differently
    from the start of the whole (one that rewrites earlier turns) is refused."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        upto = template.render(messages[: i + 1])
        a, b = (template.render([*messages[:i], {**message, "content": mark}]) for mark in ("\x00", "\x01"))
        start = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if not whole.startswith(upto) or whole[:start] != a[:start] or start > len(upto):
            raise LongtrainError(f"the chat template renders {template.record.where} differently from the conversation's "
                                 "own beginnings, so its assistant tokens cannot be found; use a template with "
                                 "{% generation %} blocks, or pass --loss-on all")
        spans.append((start, len(upto)))
    return spans
