"""Request bodies of the OpenAI API as the front end accepts them (fields it does not know are
ignored, as OpenAI's own server ignores them), and its error bodies.

Every number a field carries to the engine fits the proto field it becomes
(proto/exl3serve/v1/exl3serve.proto): integers int32, floats finite and within float32's range, so
that a value beyond them is a 400 naming the field here instead of a protobuf error (or a float
that turns into infinity on the wire)."""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

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


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

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
    logit_bias: Optional[dict[str, Float32]] = None
    user: Optional[str] = None
    # Beyond OpenAI, as vLLM accepts them.
    top_k: Optional[int] = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: Optional[Float32] = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Optional[Float32] = Field(default=None, gt=0.0)
    min_tokens: Optional[int] = Field(default=0, ge=0, le=INT32_MAX)
    stop_token_ids: Optional[list[Int32]] = None
    ignore_eos: Optional[bool] = False
    return_tokens_as_token_ids: Optional[bool] = False  # logprobs' tokens as "token_id:ID"


class CompletionRequest(_Sampling):
    # Token ids first: pydantic's smart union tries the members in order, and a million ids behind
    # str and list[str] took 0.5 s of the event loop to validate (0.1 s first). JSON's [], which
    # fits every list member, is the empty prompt whichever it becomes.
    prompt: Union[list[int], str, list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(default=16, ge=1, le=INT32_MAX)  # OpenAI's default
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: Optional[bool] = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None


class APIError(Exception):
    """An answer in OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request",
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
