"""OpenAI rendering: every answer the generation endpoints send, written as JSON text by one
renderer per request (OpenAIRenderer): the whole answer (chat.completion, text_completion), the
stream's events (chat.completion.chunk, text_completion chunks, usage, errors, [DONE]) and the
logprobs. The text is what json.dumps(ensure_ascii=False, separators=(",", ":")) gives for
OpenAI's objects, byte for byte (tests/clients/python/test_text.py holds it against that), made
from parts rendered once per request: the per-token event of the stream, the front end's hot path,
is then a few concatenations and one string escape."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

from .protocol import APIError, FinishReason
from .reasoning import Reasoning
from .text import ModelTokenizer
from .tool_calls import CallArguments, CallStart, Content, ToolCallEvent
from .validation import PreparedRequest


def dumps(obj: Any) -> str:
    """JSON text as the answers are written: compact, not ASCII-escaped."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# A str as dumps writes it (json's C encoder of ensure_ascii=False), without json.dumps' dispatch.
_jstr = json.encoder.encode_basestring

DONE_EVENT = "data: [DONE]\n\n"  # a stream's last event (sse.py ends the response with it)


def error_event(err: APIError) -> str:
    """A stream's error, as an event (the HTTP status is already sent)."""
    return "data: " + dumps(err.body()) + "\n\n"


@dataclass
class ToolCall:
    """A whole answer's tool call."""
    id: str
    name: str
    arguments: str  # JSON text


def fold_tool_calls(events: list[ToolCallEvent]) -> tuple[str, list[ToolCall]]:
    """A whole answer's parsed text: its content and its calls."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls.append(ToolCall(e.id, e.name, ""))
        elif isinstance(e, CallArguments):
            calls[e.index].arguments += e.text
    return "".join(content), calls


# A streamed chat answer's parsed text, in order (tool_calls.py, reasoning.py).
DeltaEvent = Union[ToolCallEvent, Reasoning]


class OpenAIRenderer:
    """The answer to one request (chat or completions, streamed or whole) as JSON text: one
    renderer per choice (`index`; the usage and the whole answer's frame are any one's)."""

    def __init__(self, req: PreparedRequest, tok: ModelTokenizer, index: int = 0) -> None:
        self.index = index
        self.split_reasoning = req.reasoning is not None  # the message has reasoning_content
        self.chat = req.chat
        self.tok = tok
        self.ids_as_tokens = req.ids_as_tokens
        self.top_n = req.logprobs or 0
        self.prompt_tokens = req.prompt_tokens
        self.prompt_tokens_details = req.prompt_tokens_details
        self.prompt_top_n = req.prompt_logprobs or 0  # vLLM's prompt_logprobs entries
        ident = f'{{"id":{_jstr(req.rid)},"object":'
        meta = f',"created":{int(req.created)},"model":{_jstr(req.model)},"choices":['
        chunk_object = '"chat.completion.chunk"' if req.chat else '"text_completion"'
        whole_object = '"chat.completion"' if req.chat else '"text_completion"'
        # The stream's events: head, choices, tail.
        self.head = "data: " + ident + chunk_object + meta
        self.tail = (',"usage":null}\n\n' if req.include_usage else '}\n\n')
        self.open = self.head + (f'{{"index":{index},"delta":' if req.chat
                                 else f'{{"index":{index},"text":')
        # The whole answer: its head, then the one choice.
        self.whole_head = ident + whole_object + meta

    # ---- the stream's events ---------------------------------------------------------------
    def role_event(self) -> str:
        """Chat's first event: the assistant's role and empty content."""
        return self.open + '{"role":"assistant","content":""},"logprobs":null,' \
            '"finish_reason":null}]' + self.tail

    def text_event(self, text: str, logprobs: Optional[str] = None) -> str:
        """An event with text (and logprobs, already rendered; None: null)."""
        lp = "null" if logprobs is None else logprobs
        if self.chat:
            delta = '{"content":' + _jstr(text) + "}" if text else "{}"
            return self.open + delta + ',"logprobs":' + lp + ',"finish_reason":null}]' + self.tail
        return self.open + _jstr(text) + ',"logprobs":' + lp + ',"finish_reason":null}]' + self.tail

    def finish_event(self, reason: FinishReason) -> str:
        if self.chat:
            return self.open + '{},"logprobs":null,"finish_reason":' + _jstr(reason.value) + \
                "}]" + self.tail
        return self.open + '"","logprobs":null,"finish_reason":' + _jstr(reason.value) + \
            "}]" + self.tail

    def delta_events(self, events: list[DeltaEvent], logprobs: Optional[str]) -> str:
        """The events of a chat answer whose text is parsed (for tool calls, tool_calls.py, or
        its reasoning, reasoning.py): its reasoning (delta reasoning_content, as vLLM streams
        it), its content, each call's start (id, type, name and empty arguments, as OpenAI
        streams them) and its arguments' fragments. The logprobs (rendered) go with the first
        event, or with an empty delta of their own."""
        out = []
        for e in events:
            if isinstance(e, Content):
                out.append(self.text_event(e.text, logprobs))
            elif isinstance(e, Reasoning):
                lp = "null" if logprobs is None else logprobs
                out.append(self.open + '{"reasoning_content":' + _jstr(e.text) + '},"logprobs":' +
                           lp + ',"finish_reason":null}]' + self.tail)
            else:
                if isinstance(e, CallStart):
                    call = (f'{{"index":{e.index},"id":{_jstr(e.id)},"type":"function",'
                            f'"function":{{"name":{_jstr(e.name)},"arguments":""}}}}')
                else:
                    call = f'{{"index":{e.index},"function":{{"arguments":{_jstr(e.text)}}}}}'
                lp = "null" if logprobs is None else logprobs
                out.append(self.open + '{"tool_calls":[' + call + ']},"logprobs":' + lp +
                           ',"finish_reason":null}]' + self.tail)
            logprobs = None
        if logprobs is not None:
            out.append(self.text_event("", logprobs))
        return "".join(out)

    def usage_event(self, completion_tokens: int, cached_tokens: int = 0) -> str:
        return self.head + '],"usage":' + dumps(self.usage(completion_tokens, cached_tokens)) + \
            "}\n\n"

    # ---- the whole answer ------------------------------------------------------------------
    def whole(self, text: str, logprobs: Optional[str], finish: Optional[FinishReason],
              completion_tokens: int, tool_calls: Optional[list[ToolCall]] = None,
              reasoning: Optional[str] = None) -> bytes:
        """A non-streamed answer's body: its one choice and the usage."""
        return self.answer([self.choice(text, logprobs, finish, tool_calls, reasoning)],
                           completion_tokens)

    def answer(self, choices: list[str], completion_tokens: int, cached_tokens: int = 0,
               prompt_logprobs: Optional[str] = None) -> bytes:
        """A non-streamed answer's body: its choices (rendered by choice()) and the usage; chat's
        prompt_logprobs (rendered) where asked, after the usage (vLLM's place for them)."""
        tail = "}" if prompt_logprobs is None else ',"prompt_logprobs":' + prompt_logprobs + "}"
        return (self.whole_head + ",".join(choices) + '],"usage":' +
                dumps(self.usage(completion_tokens, cached_tokens)) + tail).encode()

    def choice(self, text: str, logprobs: Optional[str], finish: Optional[FinishReason],
               tool_calls: Optional[list[ToolCall]] = None,
               reasoning: Optional[str] = None, prompt_logprobs: Optional[str] = None) -> str:
        """This renderer's choice of a whole answer. With tool calls (chat), the message has
        them, and its content is null where the model wrote none; with the reasoning split
        (--reasoning-parser), the message has reasoning_content (null where there was none, or
        include_reasoning is false) and its content is null where the model wrote none."""
        reason = "null" if finish is None else _jstr(finish.value)
        lp = "null" if logprobs is None else logprobs
        head = f'{{"index":{self.index},'
        if self.chat:
            empty_is_null = bool(tool_calls) or self.split_reasoning
            message = '"message":{"role":"assistant","content":' + \
                (_jstr(text) if text or not empty_is_null else "null")
            if self.split_reasoning:
                message += ',"reasoning_content":' + (_jstr(reasoning) if reasoning else "null")
            if tool_calls:
                calls = ",".join(f'{{"id":{_jstr(c.id)},"type":"function","function":{{"name":'
                                 f'{_jstr(c.name)},"arguments":{_jstr(c.arguments)}}}}}'
                                 for c in tool_calls)
                message += ',"tool_calls":[' + calls + "]"
            choice = head + message + "}"
        else:
            choice = head + '"text":' + _jstr(text)
        # completions' prompt_logprobs (rendered) are the choice's, as vLLM places them.
        extra = "" if prompt_logprobs is None or self.chat else \
            ',"prompt_logprobs":' + prompt_logprobs
        return choice + ',"logprobs":' + lp + ',"finish_reason":' + reason + extra + "}"

    def usage(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """The usage; with --enable-prompt-tokens-details, prompt_tokens_details.cached_tokens
        (the prompt tokens the prefix cache served), as vLLM reports it with that option."""
        u: dict[str, Any] = {"prompt_tokens": self.prompt_tokens,
                             "completion_tokens": completion_tokens,
                             "total_tokens": self.prompt_tokens + completion_tokens}
        if self.prompt_tokens_details:
            u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return u

    # ---- the prompt's logprobs -------------------------------------------------------------
    def echo_entries(self, prompt_ids: list[int], prompt_logprobs: Any) -> list[dict[str, Any]]:
        """completions' echo with logprobs: an entry per prompt token (as logprobs() renders them),
        the first without a logprob or top logprobs (null, as OpenAI and vLLM give them), the
        others with their position's (the engine's GenerateResponse.prompt_logprobs)."""
        entries: list[dict[str, Any]] = []
        for k, token_id in enumerate(prompt_ids):
            text, _ = self._token_text(token_id)
            if k == 0 or k > len(prompt_logprobs):
                entries.append({"token": text, "logprob": None, "top_logprobs": None})
                continue
            lp = prompt_logprobs[k - 1]
            tops = [{"token": self._token_text(e.token_id)[0], "logprob": e.logprob}
                    for e in lp.top_logprobs[:self.top_n]]
            entries.append({"token": text, "logprob": lp.logprob, "top_logprobs": tops})
        return entries

    def prompt_logprobs(self, prompt_logprobs: Any) -> str:
        """vLLM's prompt_logprobs, rendered: null for the first prompt token, then per token a map
        of token id to {logprob, rank, decoded_token}: the prompt's token, then its position's top
        N (prompt_logprobs' N)."""
        out: list[Optional[dict[str, Any]]] = [None]
        for lp in prompt_logprobs:
            d = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": self._token_text(lp.token_id)[0]}}
            for rank, e in enumerate(lp.top_logprobs[:self.prompt_top_n], start=1):
                d.setdefault(str(e.token_id), {"logprob": e.logprob, "rank": rank,
                                               "decoded_token": self._token_text(e.token_id)[0]})
            out.append(d)
        return dumps(out)

    # ---- logprobs --------------------------------------------------------------------------
    def logprob_entries(self, tokens: Any) -> list[dict[str, Any]]:
        """Chat's logprobs entries of the engine's GeneratedTokens (completions' are made of them)."""
        entries = []
        for t in tokens:
            text, b = self._token_text(t.token_id)
            tops = []
            for e in t.top_logprobs[:self.top_n]:
                et, eb = self._token_text(e.token_id)
                tops.append({"token": et, "logprob": e.logprob, "bytes": list(eb)})
            entries.append({"token": text, "logprob": t.logprob, "bytes": list(b),
                            "top_logprobs": tops})
        return entries

    def logprobs(self, entries: list[dict[str, Any]], offset: int) -> str:
        """A choice's `logprobs`, rendered: chat's {"content": entries}, or completions' lists with
        each token's offset in the answer's text, from `offset` (the text before these tokens)."""
        if self.chat:
            return dumps({"content": entries, "refusal": None})
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for e in entries:
            out["tokens"].append(e["token"])
            out["token_logprobs"].append(e["logprob"])
            top = e["top_logprobs"]  # None: the first prompt token's (echo)
            out["top_logprobs"].append(None if top is None else
                                       {t["token"]: t["logprob"] for t in top})
            out["text_offset"].append(offset)
            offset += len(e["token"])
        return dumps(out)

    def _token_text(self, token_id: int) -> tuple[str, bytes]:
        if self.ids_as_tokens:
            s = f"token_id:{token_id}"
            return s, s.encode()
        return self.tok.token_text(token_id)
