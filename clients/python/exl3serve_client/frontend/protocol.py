"""Request bodies of the OpenAI API as the front end accepts them, and its error bodies. A field
that vLLM honours and this server does not (UNSUPPORTED_FIELDS) is refused 400 naming it unless its
value changes nothing; other fields it does not know are ignored, as OpenAI's and vLLM's servers
ignore them.

Every number a field carries to the engine fits the proto field it becomes
(proto/exl3serve/v1/exl3serve.proto): integers int32, floats finite and within float32's range, so
that a value beyond them is a 400 naming the field here instead of a protobuf error (or a float
that turns into infinity on the wire)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32


def _within_float32(x: float) -> float:
    if abs(x) > FLOAT32_MAX:  # a finite double that float32 would make infinite
        raise ValueError(f"{x!r} is beyond the range of a 32-bit float (|x| <= 3.4028235e38)")
    return x


# A float the engine gets as a proto float: finite (the models' allow_inf_nan=False) and in range.
Float32 = Annotated[float, AfterValidator(_within_float32)]
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]

# Chat's top-level reasoning_effort, the values vLLM's ChatCompletionRequest takes; it reaches the
# chat template as its `reasoning_effort` (validation.py, template_kwargs). Other values (a
# template's own, such as DeepSeek-V4's "none" and "max") go in chat_template_kwargs.
ReasoningEffort = Literal["low", "medium", "high"]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: Optional[bool] = False  # vLLM's usage in every chunk: refused


@dataclass(frozen=True)
class Unsupported:
    """A request field vLLM honours that this server does not: refused 400 naming it unless its
    value is None or one of `no_ops` (vLLM's defaults, which change nothing)."""
    why: str
    no_ops: tuple[Any, ...] = ()


_BEAM = Unsupported("beam search is not supported", (False,))

# Fields of vLLM's request bodies (and OpenAI's, where vLLM honours them) that neither endpoint
# honours. Fields the models below declare are checked by the front end itself (app.py).
UNSUPPORTED_FIELDS: dict[str, Unsupported] = {
    # Constraints are compiled by xgrammar, whatever backend is named.
    "guided_decoding_backend": Unsupported("the constraint backend is xgrammar's, always",
                                           ("xgrammar", "auto", "")),
    "guided_whitespace_pattern": Unsupported("guided_whitespace_pattern is not supported: JSON "
                                             "constraints are compiled by xgrammar into compact "
                                             "JSON (no whitespace between tokens), which takes "
                                             "no whitespace pattern"),
    "use_beam_search": _BEAM,
    "length_penalty": Unsupported("length_penalty (of beam search) is not supported", (1.0,)),
    "include_stop_str_in_output": Unsupported("include_stop_str_in_output is not supported: the "
                                              "answer ends before its stop string", (False,)),
    "skip_special_tokens": Unsupported("special tokens are always skipped in the text", (True,)),
    "spaces_between_special_tokens": Unsupported("special tokens are always skipped in the text",
                                                 (True,)),
    "truncate_prompt_tokens": Unsupported("prompt truncation is not supported"),
    "allowed_token_ids": Unsupported("allowed_token_ids is not supported (logit_bias of -100 "
                                     "on the others is close)", ([],)),
    "bad_words": Unsupported("bad_words is not supported", ([],)),
    "logits_processors": Unsupported("logits processors are not supported", ([],)),
    "priority": Unsupported("request priorities are not supported", (0,)),
    "return_token_ids": Unsupported("return_token_ids is not supported (logprobs with "
                                    "return_tokens_as_token_ids give the ids)", (False,)),
    "cache_salt": Unsupported("cache_salt is not supported: the prefix cache is shared"),
    "kv_transfer_params": Unsupported("KV transfer is not supported"),
    "vllm_xargs": Unsupported("vllm_xargs is not supported"),
    "prompt_embeds": Unsupported("prompt embeddings are not supported"),
    # vLLM's stop on a repeated token pattern (0: off).
    "max_repetition_pattern_size": Unsupported("stopping on repeated token patterns is not "
                                               "supported", (0,)),
    "min_repetition_pattern_size": Unsupported("stopping on repeated token patterns is not "
                                               "supported", (0,)),
    "repetition_min_count": Unsupported("stopping on repeated token patterns is not supported",
                                        (0,)),
}
# Chat only (on completions these names mean nothing to vLLM).
UNSUPPORTED_CHAT_FIELDS: dict[str, Unsupported] = {
    "functions": Unsupported("functions (OpenAI's deprecated tool calls) are not supported", ([],)),
    "function_call": Unsupported("function_call (OpenAI's deprecated tool calls) is not "
                                 "supported", ("none",)),
    "echo": Unsupported("echo of the last message is not supported", (False,)),
    "continue_final_message": Unsupported("continue_final_message is not supported", (False,)),
    "documents": Unsupported("documents are not supported", ([],)),
    "chat_template": Unsupported("a chat template in the request is not supported: the model's "
                                 "is used"),
    "mm_processor_kwargs": Unsupported("multimodal inputs are not supported", ({},)),
}


def unsupported_field(extra: Optional[dict[str, Any]],
                      table: dict[str, Unsupported]) -> Optional[tuple[str, str]]:
    """The first field of `extra` (a body's undeclared fields) that `table` refuses with the value
    given: (name, why); None if none."""
    if not extra:
        return None
    for name, value in extra.items():
        u = table.get(name)
        # A bool matches only a bool: in Python True == 1.0 and False == 0.
        if u is not None and value is not None and not any(
                value == v and isinstance(value, bool) == isinstance(v, bool) for v in u.no_ops):
            return name, u.why
    return None


class _Sampling(BaseModel):
    # Undeclared fields are kept (model_extra) so that UNSUPPORTED_FIELDS can name them.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1, le=INT32_MAX)
    temperature: Optional[Float32] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[Float32] = Field(default=None, gt=0.0, le=1.0)
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[Float32] = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Optional[Float32] = Field(default=0.0, ge=-2.0, le=2.0)
    seed: Optional[int] = None  # any integer: the engine's uint64 seed is its low 64 bits
    logit_bias: Optional[dict[str, Float32]] = None  # structured_output.py
    user: Optional[str] = None
    # With structured_outputs and guided_* (kept in model_extra): structured_output.py.
    response_format: Optional[dict[str, Any]] = None
    best_of: Optional[int] = None
    # Beyond OpenAI, as vLLM accepts them.
    top_k: Optional[int] = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: Optional[Float32] = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Optional[Float32] = Field(default=None, gt=0.0)
    min_tokens: Optional[int] = Field(default=0, ge=0, le=INT32_MAX)
    stop_token_ids: Optional[list[Int32]] = None
    ignore_eos: Optional[bool] = False
    return_tokens_as_token_ids: Optional[bool] = False  # logprobs' tokens as "token_id:ID"
    # vLLM's: every prompt token's logprob and the top N of its position (the first has none).
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    # Speculative decoding for this request (the engine's GenerateRequest.num_speculative_tokens):
    # 0 turns it off, 1..K caps its drafts per step; unset, the server's K. The engine refuses
    # values above its K, and any above 0 when it runs without speculative decoding.
    num_speculative_tokens: Optional[int] = Field(default=None, ge=0, le=INT32_MAX)
    request_id: Optional[str] = None  # the answer's and the engine's request id (X-Request-Id wins)


class CompletionRequest(_Sampling):
    # Token ids first: pydantic's smart union tries the members in order, and a million ids behind
    # str and list[str] took 0.5 s of the event loop to validate (0.1 s first). JSON's [], which
    # fits every list member, is the empty prompt whichever it becomes.
    # Several prompts (a list of texts or of token-id lists): one choice per prompt and n.
    prompt: Union[list[int], str, list[str], list[list[int]]]
    # OpenAI's default. 0 only with echo: the answer is the prompt alone (validation.py).
    max_tokens: Optional[int] = Field(default=16, ge=0, le=INT32_MAX)
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    # vLLM's: the tokenizer's special tokens (BOS) added to a text prompt (not to token ids).
    add_special_tokens: Optional[bool] = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's calls (arguments: JSON text)
    tool_call_id: Optional[str] = None                 # a tool result's call


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None  # rendered by the chat template (validation.py)
    tool_choice: Optional[Any] = None             # none, auto; required and named: refused
    parallel_tool_calls: Optional[bool] = None    # False: the first call only (tool_calls.py)
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # vLLM's: false drops the reasoning from the answer (with --reasoning-parser; validation.py).
    include_reasoning: Optional[bool] = None
    # Passed to the chat template as `reasoning_effort` (validation.py, template_kwargs).
    reasoning_effort: Optional[ReasoningEffort] = None
    # vLLM's: the tokenizer's special tokens (BOS) added on top of the rendering's own.
    add_special_tokens: Optional[bool] = False


class TokenizeRequest(BaseModel):
    """POST /tokenize as vLLM takes it: a prompt, or chat messages rendered with the chat template
    (add_special_tokens' default: True for a prompt, False for messages, whose rendering holds
    them)."""
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    return_token_strs: Optional[bool] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[ReasoningEffort] = None  # as chat's
    tools: Optional[list[dict[str, Any]]] = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize as vLLM takes it."""
    model: Optional[str] = None
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]]


class Endpoint(str, Enum):
    """A generation endpoint, by the name its metrics' `endpoint` label carries."""
    COMPLETIONS = "completions"              # POST /v1/completions
    CHAT_COMPLETIONS = "chat_completions"    # POST /v1/chat/completions


class FinishReason(str, Enum):
    """A choice's finish_reason in OpenAI's answers."""
    STOP = "stop"              # the model's end token, or a stop string or stop token of the request
    LENGTH = "length"          # max_tokens, or the context, reached
    TOOL_CALLS = "tool_calls"  # the answer ends with the model's tool calls (tool_calls.py)


# The HTTP status a request is counted under when its client went away before its answer ended
# (nginx's "client closed request"; no answer is sent with it).
CLIENT_CLOSED_REQUEST = 499


class APIError(Exception):
    """An answer in OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
             404: "invalid_request_error", 405: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error",
             CLIENT_CLOSED_REQUEST: "client_closed_request",
             500: "server_error", 503: "service_unavailable", 504: "timeout"}

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}
