"""Request validation: an OpenAI request body read (up to --max-request-body-bytes), parsed by
pydantic (protocol.py's models) and checked, then made into a PreparedRequest, the typed request
the rest of the front end works from (the engine's GenerateRequest and what the answer needs).
Every refusal is an APIError naming the field (`param`), raised before the engine is asked."""

from __future__ import annotations

import enum
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, MutableMapping, Optional, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from exl3serve.v1 import exl3serve_pb2 as pb

from ..generate import make_generate_request
from .protocol import (INT32_MAX, UNSUPPORTED_CHAT_FIELDS, UNSUPPORTED_FIELDS, APIError,
                       ChatCompletionRequest, ChatMessage, CompletionRequest, Endpoint,
                       TokenizeRequest, _Sampling, unsupported_field)
from .reasoning import ReasoningFormat, ReasoningParser
from .structured_output import (logit_bias, request_constraint, set_after_reasoning,
                                set_constraint)
from .text import ChatTemplateError, ModelTokenizer
from .tokenizer_process import TokenizerProcess, TokenizerProcessDied
from .tool_call_grammar import tool_call_constraint
from .tool_calls import ToolCallFormat, ToolCallParser

# A prompt text at least this long is tokenized in the tokenizer process (RequestValidator's
# prompt_ids); a shorter one on the event loop, where it costs less than the handover (8192
# characters: 2-3.5 ms with the test models' tokenizer, about 0.5 ms to and from the process).
TOKENIZE_OFF_LOOP_CHARS = 8192

# A client's request id (X-Request-Id, or vLLM's request_id field): visible ASCII, this long at most.
MAX_REQUEST_ID_CHARS = 128

# At most this many stop strings per request.
MAX_STOP_STRINGS = 16

# --max-n's default: the most choices one request may ask for.
DEFAULT_MAX_N = 16

# At most this many prompts in one completions request (each prompt's n choices are engine requests).
MAX_PROMPTS = 256

_U64 = 0xFFFFFFFFFFFFFFFF


def choice_seed(seed: int, index: int) -> int:
    """The engine's seed of choice `index` of a request with `seed`: the seed itself for choice 0
    (so n=1 samples as before), else a 64-bit mix of (seed, index) (splitmix64's finalizer over
    seed + index * 0x9E3779B97F4A7C15): the choices differ from each other, and the same request
    gives the same choices again."""
    if index == 0:
        return seed & _U64
    z = (seed + index * 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


class ForcedCalls(enum.Enum):
    """What tool_choice makes the answer (tool_call_grammar.py constrains it)."""
    NONE = enum.auto()         # auto: text, calls or both, as the model writes
    ONE = enum.auto()          # a named function, or required without parallel_tool_calls
    ONE_OR_MORE = enum.auto()  # required with parallel_tool_calls


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools, as its answer is parsed for their calls (tool_calls.py)."""
    fmt: ToolCallFormat
    schemas: dict[str, Any]   # function name -> its parameters' JSON schema
    parallel: bool            # parallel_tool_calls
    # tool_choice required (every tool) or a named function (that one): the answer is calls
    # of these only (`calls` says how many), constrained to their schemas.
    forced: tuple[str, ...] = ()
    calls: ForcedCalls = ForcedCalls.NONE

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.fmt, self.schemas, self.parallel)


@dataclass(frozen=True)
class ReasoningSplit:
    """A chat answer's reasoning split from its content (reasoning.py, --reasoning-parser)."""
    fmt: ReasoningFormat
    include: bool             # include_reasoning: the reasoning is in the answer
    starts_inside: bool       # the output starts inside the reasoning (deepseek_v4: per request)

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self.fmt, self.starts_inside)


@dataclass
class PreparedRequest:
    """One generation request, validated: the engine request and what the answer needs."""
    endpoint: Endpoint
    model: str
    prompts: list[list[int]]         # token ids; several only for completions' list of prompts
    engine_request: pb.GenerateRequest  # of prompts[0] (choice_requests makes every choice's)
    stops: list[str]
    stream: bool
    include_usage: bool
    logprobs: Optional[int]          # top-N asked (0: the chosen token's only); None: none
    ids_as_tokens: bool = False      # logprobs name tokens "token_id:ID" (vLLM's extension)
    tool_use: Optional[ToolUse] = None  # the answer's text is parsed for tool calls
    reasoning: Optional[ReasoningSplit] = None  # the answer's reasoning is split from its content
    n: int = 1                       # choices: n generations of each prompt (choice_requests)
    # completions' echo: each choice's text (and logprobs) starts with its prompt's
    echo: Optional["Echo"] = None
    prompt_logprobs: Optional[int] = None  # vLLM's prompt_logprobs field (the answer's)
    prompt_tokens_details: bool = False  # usage has prompt_tokens_details (cached_tokens)
    header_rid: str = ""             # the answer's X-Request-Id: the client's id, else rid
    started: float = field(default_factory=time.monotonic)
    rid: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chat(self) -> bool:
        return self.endpoint is Endpoint.CHAT_COMPLETIONS

    @property
    def prompt_tokens(self) -> int:
        """The usage's prompt tokens: every prompt's, once (not once per choice)."""
        return sum(len(p) for p in self.prompts)

    def prompt_of(self, choice: int) -> int:
        """The prompt (index into prompts) of choice `choice`: OpenAI numbers a request's choices
        prompt by prompt, n each."""
        return choice // self.n

    def choice_requests(self) -> list[pb.GenerateRequest]:
        """The engine request of each choice, prompt by prompt and n each: engine_request for
        one; else copies with the choice's prompt, whose request_id ends -INDEX and whose seed (if
        the request has one) is choice_seed's of the choice's number among its prompt's n."""
        if self.n == 1 and len(self.prompts) == 1:
            return [self.engine_request]
        out = []
        for p, ids in enumerate(self.prompts):
            for i in range(self.n):
                r = pb.GenerateRequest()
                r.CopyFrom(self.engine_request)
                if p > 0:
                    r.prompt_token_ids[:] = ids
                r.request_id = f"{self.engine_request.request_id}-{p * self.n + i}"
                if self.engine_request.sampling.HasField("seed"):
                    r.sampling.seed = choice_seed(self.engine_request.sampling.seed, i)
                out.append(r)
        return out


@dataclass(frozen=True)
class Echo:
    """completions' echo: the prompts' texts that start their choices' texts; `only`: max_tokens 0,
    the answer is the prompt alone (as vLLM, the engine makes one token, which is dropped)."""
    texts: list[str]
    only: bool = False


def client_request_id(value: Optional[str], what: str) -> Optional[str]:
    """The client's request id, checked: it goes into the answer's id, a header and the engine's
    logs."""
    if value is None or value == "":
        return None
    if len(value) > MAX_REQUEST_ID_CHARS or not all("!" <= c <= "~" for c in value):
        raise APIError(400, f"{what} must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII "
                       "characters", param="request_id" if what == "request_id" else None)
    return value


def template_kwargs(given: Optional[dict[str, Any]],
                    reasoning_effort: Optional[str]) -> dict[str, Any]:
    """The chat template's keyword arguments: the request's chat_template_kwargs, and its
    top-level reasoning_effort as the template's `reasoning_effort` (as vLLM passes it). Where
    both name a reasoning_effort and they differ, neither is taken: a 400 naming both (vLLM lets
    the top-level field win; a client that sends two values has made a mistake worth hearing
    about)."""
    kwargs = dict(given or {})
    if reasoning_effort is not None:
        inner = kwargs.get("reasoning_effort")
        if inner is not None and inner != reasoning_effort:
            raise APIError(400, f"reasoning_effort {reasoning_effort!r} and "
                           f"chat_template_kwargs.reasoning_effort {inner!r} differ: give one "
                           "of them", param="reasoning_effort")
        kwargs["reasoning_effort"] = reasoning_effort
    return kwargs


def prompt_too_long(ctx: int, tokens: int, param: str, at_least: bool = False) -> APIError:
    """OpenAI's refusal of a prompt of the context's length or more (`at_least`: a lower bound
    of its tokens, from its length in bytes)."""
    has = f"at least {tokens}" if at_least else str(tokens)
    return APIError(400, f"This model's maximum context length is {ctx} tokens. However, your "
                    f"prompt has {has} tokens.", param=param, code="context_length_exceeded")


async def read_body(receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
                    limit: int) -> bytes:
    """The request's body, refused (413) past `limit` bytes. The rest of a body that is too large
    is still read, and dropped, before the answer: a client that sends its whole body before it
    reads the answer (the openai SDK does) would get a broken connection instead of the 413 if
    the server closed it early."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if chunk and size <= limit:
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if size > limit:
        raise APIError(413, f"the request body is {size} bytes, more than this server takes "
                       f"({limit} bytes, exl3serve-openai --max-request-body-bytes)",
                       code="request_too_large")
    return b"".join(chunks)


Body = TypeVar("Body", bound=BaseModel)


def parse_body(raw: bytes, body_type: type[Body]) -> Body:
    """The body as `body_type`; pydantic's first complaint about it a 400 naming the field."""
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        if not errs:
            raise APIError(400, "invalid request") from None
        loc = ".".join(str(x) for x in errs[0]["loc"])
        msg = errs[0]["msg"]
        raise APIError(400, f"{loc}: {msg}" if loc else msg, param=loc or None) from None


def check_model(model: Optional[str], served: str) -> None:
    """A request's `model` (None: not given) must be the served model's name."""
    if model is not None and model != served:
        raise APIError(404, f"The model `{model}` does not exist.", param="model",
                       code="model_not_found")


def refuse_unsupported(extra: Optional[dict[str, Any]], table: dict[str, Any]) -> None:
    """A 400 naming the first undeclared field that `table` (protocol.py) refuses."""
    refused = unsupported_field(extra, table)
    if refused is not None:
        name, why = refused
        raise APIError(400, f"{name}: {why}", param=name)


def _tool_schemas(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The request's tools checked (OpenAI's {"type": "function", "function": {"name", ...}}):
    each function's name -> its parameters' JSON schema."""
    schemas: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                           "{\"name\": ...}}", param="tools")
        params = fn.get("parameters", {})
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema (an "
                           "object)", param="tools")
        schemas[fn["name"]] = params
    return schemas


def _call_for_template(call: dict[str, Any], where: str, as_text: bool) -> dict[str, Any]:
    """An assistant message's tool call as chat templates take it: the function's arguments an
    object (OpenAI sends them as JSON text), or, `as_text` (templates that concatenate them:
    DeepSeek's), the object's JSON text."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where} must be {{\"type\": \"function\", \"function\": "
                       "{\"name\": ..., \"arguments\": ...}}", param="messages")
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object", param="messages")
    if as_text:
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {**call, "function": {**fn, "arguments": arguments}}


def _checked_tool_results(chat: list[ChatMessage], sort: bool) -> list[ChatMessage]:
    """The messages with each `tool` result checked against the calls it answers: its
    `tool_call_id` must name a call of the assistant message before it (a 400 naming
    messages[i].tool_call_id where it does not). With `sort` (DeepSeek-V4's encoding does it), the
    results that one user-side turn (the tool and user messages after an assistant message) gives
    of one assistant turn's calls take their places in the order of the calls, whatever order the
    client sent them in; the turn's user messages keep theirs."""
    out = list(chat)
    calls: dict[str, int] = {}  # the last assistant message's call ids -> their order
    turn: list[int] = []        # the positions of the current user-side turn's id'd results
    for i, m in enumerate(chat + [ChatMessage(role="assistant")]):  # a sentinel ends the last turn
        if m.role == "tool" and m.tool_call_id is not None:
            if m.tool_call_id not in calls:
                raise APIError(400, f"messages[{i}].tool_call_id {m.tool_call_id!r} names no tool "
                               "call of the assistant message before it",
                               param=f"messages[{i}].tool_call_id")
            turn.append(i)
        elif m.role not in ("tool", "user"):
            if sort and len(turn) > 1:
                ordered = sorted((chat[k] for k in turn), key=lambda t: calls[t.tool_call_id or ""])
                for k, t in zip(turn, ordered):
                    out[k] = t
            turn = []
            if m.role == "assistant":
                calls = {c["id"]: n for n, c in enumerate(m.tool_calls or [])
                         if isinstance(c, dict) and isinstance(c.get("id"), str)}
    return out


class RequestValidator:
    """Makes PreparedRequests of the generation endpoints' bodies, and renders chat messages.
    `model_name` and `max_context` are asked per request: both follow what the engine said."""

    def __init__(self, tok: ModelTokenizer, tokenizer_process: TokenizerProcess,
                 model_name: Callable[[], str], max_context: Callable[[], int],
                 request_timeout_s: float,
                 tool_format: Optional[ToolCallFormat] = None,
                 reasoning_format: Optional[ReasoningFormat] = None,
                 max_n: int = DEFAULT_MAX_N, prompt_tokens_details: bool = False) -> None:
        self.tok = tok
        self.prompt_tokens_details = prompt_tokens_details  # --enable-prompt-tokens-details
        self.tool_format = tool_format  # the model's tool-call format (None: it has none)
        self.reasoning_format = reasoning_format  # --reasoning-parser (None: not split)
        self.max_n = max_n
        self.tokenizer_process = tokenizer_process
        self.model_name = model_name
        self.max_context = max_context
        self.request_timeout_s = request_timeout_s

    # ---- the endpoints' bodies -------------------------------------------------------------
    async def completion(self, body: CompletionRequest,
                         client_rid: Optional[str]) -> PreparedRequest:
        self._common(body, Endpoint.COMPLETIONS)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        p = body.prompt
        # One prompt (a text or token ids), or several (texts or token-id lists).
        if isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            given: list[Any] = [p]
        else:
            given = list(p)
        if len(given) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, not {len(given)}",
                           param="prompt")
        if len(given) * (body.n or 1) > MAX_PROMPTS:
            raise APIError(400, f"{len(given)} prompts x n={body.n} choices: at most {MAX_PROMPTS} "
                           "choices per request", param="n")
        prompts = []
        for k, one in enumerate(given):
            if isinstance(one, str):
                prompts.append(await self.prompt_ids(one, body.add_special_tokens is not False,
                                                      "prompt"))
                continue
            ids = [t for t in one if isinstance(t, int)]  # all of them
            if ids and (min(ids) < -INT32_MAX - 1 or max(ids) > INT32_MAX):
                i, bad = next((i, t) for i, t in enumerate(ids)
                              if not -INT32_MAX - 1 <= t <= INT32_MAX)
                where = "prompt" if len(given) == 1 else f"prompt {k}"
                raise APIError(400, f"{where} token {i} is {bad}, beyond a token id's range "
                               "(int32)", param="prompt")
            prompts.append(ids)
        max_tokens = body.max_tokens
        echo = None
        if body.echo:
            # The prompt's text as given, or its tokens' text.
            texts = [one if isinstance(one, str) else self.tok.decode(ids)
                     for one, ids in zip(given, prompts)]
            echo = Echo(texts, only=max_tokens == 0)
            if max_tokens == 0:
                max_tokens = 1  # the engine makes one token, which the answer leaves out
        elif max_tokens == 0:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt "
                           "alone)", param="max_tokens")
        return self._prepare(body, Endpoint.COMPLETIONS, prompts, max_tokens, body.logprobs,
                             client_rid, echo=echo)

    async def chat(self, body: ChatCompletionRequest,
                   client_rid: Optional[str]) -> PreparedRequest:
        self._common(body, Endpoint.CHAT_COMPLETIONS)
        tool_use = self._tool_use(body)
        kwargs = template_kwargs(body.chat_template_kwargs, body.reasoning_effort)
        reasoning = self._reasoning(body, kwargs)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        text = self.chat_prompt(body.messages, body.add_generation_prompt, kwargs, body.tools)
        # As encode_chat: the rendering holds its special tokens (unless the client asks for the
        # tokenizer's on top, vLLM's add_special_tokens).
        ids = await self.prompt_ids(text, bool(body.add_special_tokens), "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return self._prepare(body, Endpoint.CHAT_COMPLETIONS, [ids], max_tokens, logprobs,
                             client_rid,
                             "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
                             tool_use, reasoning)

    def _reasoning(self, body: ChatCompletionRequest,
                   kwargs: dict[str, Any]) -> Optional[ReasoningSplit]:
        """How the answer's reasoning is split (None: it is not, without --reasoning-parser);
        `kwargs`: the chat template's (template_kwargs)."""
        if self.reasoning_format is None:
            if body.include_reasoning is False:
                raise APIError(400, "include_reasoning: reasoning is not split from the content "
                               "(exl3serve-openai --reasoning-parser names a format)",
                               param="include_reasoning")
            return None
        return ReasoningSplit(self.reasoning_format, body.include_reasoning is not False,
                              self.reasoning_format.starts_in_reasoning(kwargs))

    def _tool_use(self, body: ChatCompletionRequest) -> Optional[ToolUse]:
        """The request's tools checked; how its answer is parsed for their calls (None: it is not,
        as without tools or with tool_choice none)."""
        choice = body.tool_choice
        named = None
        if isinstance(choice, dict):
            fn = choice.get("function")
            if choice.get("type") != "function" or not isinstance(fn, dict) or \
                    not isinstance(fn.get("name"), str):
                raise APIError(400, "tool_choice must be none, auto, required or {\"type\": "
                               "\"function\", \"function\": {\"name\": ...}}", param="tool_choice")
            named = fn["name"]
        elif choice not in (None, "none", "auto", "required"):
            raise APIError(400, f"tool_choice must be none, auto, required or a named function, "
                           f"not {choice!r}", param="tool_choice")
        schemas = _tool_schemas(body.tools or [])
        forced = choice == "required" or named is not None
        if forced and not schemas:
            raise APIError(400, "tool_choice required or a named function needs tools",
                           param="tool_choice")
        if named is not None and named not in schemas:
            raise APIError(400, f"tool_choice names the function {named!r}, which is not among "
                           "the tools", param="tool_choice")
        if not schemas or choice == "none":
            return None
        if self.tool_format is None:
            raise APIError(400, "tools: this model's chat template writes no tool-call format the "
                           "front end parses (exl3serve-openai --tool-call-parser names one: "
                           f"{', '.join(f.value for f in ToolCallFormat)})", param="tools")
        parallel = body.parallel_tool_calls is not False
        names = (named,) if named is not None else tuple(schemas) if forced else ()
        calls = ForcedCalls.NONE if not forced else \
            ForcedCalls.ONE_OR_MORE if named is None and parallel else ForcedCalls.ONE
        return ToolUse(self.tool_format, schemas, parallel, names, calls)

    def tokenize_text(self, body: TokenizeRequest) -> tuple[str, bool]:
        """/tokenize's body checked: the text to tokenize and whether to add special tokens."""
        check_model(body.model, self.model_name())
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        _tool_schemas(body.tools or [])
        refuse_unsupported(body.model_extra, UNSUPPORTED_CHAT_FIELDS)
        if body.messages is not None:
            text = self.chat_prompt(body.messages, body.add_generation_prompt,
                                    template_kwargs(body.chat_template_kwargs,
                                                    body.reasoning_effort), body.tools)
            return text, bool(body.add_special_tokens)
        return body.prompt or "", body.add_special_tokens is not False

    def chat_prompt(self, chat: list[ChatMessage], add_generation_prompt: bool,
                    template_kwargs: Optional[dict[str, Any]],
                    tools: Optional[list[dict[str, Any]]] = None) -> str:
        """The messages rendered with the model's chat template (with the request's tools, where
        it has any: the template's `tools`, as transformers passes them)."""
        messages = []
        # DeepSeek-V4's encoding sorts tool results by their calls; its template (the test
        # models') keeps the messages' order, so the front end sorts them.
        chat = _checked_tool_results(chat, self.tool_format is ToolCallFormat.DEEPSEEK_V4)
        for i, m in enumerate(chat):
            msg = m.model_dump(exclude_none=True)
            if m.tool_calls:
                as_text = self.tool_format is not None and self.tool_format.arguments_as_text
                msg["tool_calls"] = [_call_for_template(c, f"messages[{i}].tool_calls[{j}]",
                                                        as_text)
                                     for j, c in enumerate(m.tool_calls)]
            if isinstance(m.content, list):  # content parts: their text, in order
                parts = []
                for part in m.content:
                    if part.get("type") != "text":
                        raise APIError(400, f"content part of type {part.get('type')!r} is not "
                                       "supported", param="messages")
                    parts.append(part.get("text", ""))
                msg["content"] = "".join(parts)
            msg.setdefault("content", "")
            messages.append(msg)
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        try:
            return self.tok.render_chat(messages, add_generation_prompt, **kwargs)
        except ChatTemplateError as e:
            raise APIError(400, f"chat template: {e}", param="messages") from None

    async def prompt_ids(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """The prompt text's token ids. A long text is first held against the context by the
        tokenizer's lower bound of its tokens (refused untokenized where that already exceeds it),
        then tokenized in the tokenizer process (tokenizer_process.py), so that the event loop
        serves the other requests meanwhile; one of the context's length or more is refused
        without its ids made. A short one is tokenized here (_prepare checks its length)."""
        if len(text) < TOKENIZE_OFF_LOOP_CHARS:
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        ctx = self.max_context()
        at_least = self.tok.min_token_count(text)
        if at_least >= ctx:
            raise prompt_too_long(ctx, at_least, param, at_least=True)
        try:
            n, ids = await self.tokenizer_process.encode(text, ctx, add_special_tokens)
        except TokenizerProcessDied as e:
            raise APIError(500, str(e)) from None
        if ids is None:
            raise prompt_too_long(ctx, n, param)
        return ids

    async def any_length_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """The text's token ids whatever their number (/tokenize: the body's limit is the bound)."""
        if len(text) < TOKENIZE_OFF_LOOP_CHARS:
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        try:
            _, got = await self.tokenizer_process.encode(text, INT32_MAX, add_special_tokens)
        except TokenizerProcessDied as e:
            raise APIError(500, str(e)) from None
        return got or []

    # ---- what both endpoints check ---------------------------------------------------------
    def _common(self, body: _Sampling, endpoint: Endpoint) -> None:
        check_model(body.model, self.model_name())
        refuse_unsupported(body.model_extra, UNSUPPORTED_FIELDS)
        if endpoint is Endpoint.CHAT_COMPLETIONS:
            refuse_unsupported(body.model_extra, UNSUPPORTED_CHAT_FIELDS)
        if body.n is not None and not 1 <= body.n <= self.max_n:
            raise APIError(400, f"n must be 1 to {self.max_n} (exl3serve-openai --max-n), not "
                           f"{body.n}", param="n")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported: n gives n choices, all of them "
                           "returned", param="best_of")
        if body.stream_options is not None and body.stream_options.continuous_usage_stats:
            raise APIError(400, "stream_options.continuous_usage_stats is not supported: the "
                           "usage comes in the stream's last chunk (include_usage)",
                           param="stream_options.continuous_usage_stats")

    @staticmethod
    def _stops(body: _Sampling) -> list[str]:
        stop = body.stop
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
        return [s for s in stops if s]

    def _prepare(self, body: _Sampling, endpoint: Endpoint, prompts: list[list[int]],
                 max_tokens: Optional[int], logprobs: Optional[int], client_rid: Optional[str],
                 max_tokens_param: str = "max_tokens",
                 tool_use: Optional[ToolUse] = None,
                 reasoning: Optional[ReasoningSplit] = None,
                 echo: Optional[Echo] = None) -> PreparedRequest:
        chat = endpoint is Endpoint.CHAT_COMPLETIONS
        if not prompts or not all(prompts):
            raise APIError(400, "the prompt is empty", param="prompt")
        ctx = self.max_context()
        longest = max(len(p) for p in prompts)
        if longest >= ctx:
            raise prompt_too_long(ctx, longest, "messages" if chat else "prompt")
        if max_tokens is None:
            max_tokens = ctx - longest
        elif longest + max_tokens > ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, "
                           f"you requested {longest + max_tokens} tokens "
                           f"({longest} in the prompt, {max_tokens} for the completion). "
                           "Please reduce the length of the prompt or the completion.",
                           param=max_tokens_param, code="context_length_exceeded")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400, "prompt_logprobs is not available with stream (as vLLM): ask "
                           "without stream, or use echo with logprobs on completions",
                           param="prompt_logprobs")
        # The engine's prompt logprobs: vLLM's field, and echo's with logprobs (its top N).
        wanted = [k for k in (body.prompt_logprobs,
                              logprobs if echo is not None else None) if k is not None]
        temperature = 1.0 if body.temperature is None else body.temperature
        seed = None if body.seed is None else body.seed & 0xFFFFFFFFFFFFFFFF
        client_rid = client_rid or client_request_id(body.request_id, "request_id")
        rid = ("chatcmpl-" if chat else "cmpl-") + (client_rid or uuid.uuid4().hex)
        req = make_generate_request(
            prompts[0], max_tokens=max_tokens, temperature=temperature,
            top_p=body.top_p or 0.0, top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0,
            repetition_penalty=body.repetition_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, seed=seed,
            logprobs=logprobs or 0, min_tokens=body.min_tokens or 0,
            stop_token_ids=body.stop_token_ids or (), ignore_eos=bool(body.ignore_eos),
            timeout_us=int(self.request_timeout_s * 1e6), request_id=rid)
        forced_call = None if tool_use is None else tool_call_constraint(
            tool_use.fmt, tool_use.schemas, tool_use.forced,
            several=tool_use.calls is ForcedCalls.ONE_OR_MORE)
        constraint = request_constraint(body.response_format, body.model_extra, forced_call)
        if constraint is not None:
            set_constraint(req.sampling, constraint)
            if reasoning is not None:  # the model thinks freely first
                set_after_reasoning(req.sampling, reasoning.starts_inside)
        for token, bias in logit_bias(body.logit_bias).items():
            req.sampling.logit_bias[token] = bias
        if wanted:
            req.prompt_logprobs = max(wanted)
        if body.num_speculative_tokens is not None:
            req.num_speculative_tokens = body.num_speculative_tokens
        return PreparedRequest(
            endpoint=endpoint, model=self.model_name(), prompts=prompts,
            engine_request=req, stops=self._stops(body), stream=bool(body.stream),
            include_usage=bool(body.stream and body.stream_options and
                               body.stream_options.include_usage),
            logprobs=logprobs, rid=rid, header_rid=client_rid or rid,
            ids_as_tokens=bool(body.return_tokens_as_token_ids), tool_use=tool_use,
            reasoning=reasoning, n=body.n or 1, echo=echo,
            prompt_logprobs=body.prompt_logprobs,
            prompt_tokens_details=self.prompt_tokens_details)
