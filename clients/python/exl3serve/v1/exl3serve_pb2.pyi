from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FP32: _ClassVar[DType]
    DTYPE_FP16: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]

class StatusCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[StatusCode]
    CANCELLED: _ClassVar[StatusCode]
    UNKNOWN: _ClassVar[StatusCode]
    INVALID_ARGUMENT: _ClassVar[StatusCode]
    DEADLINE_EXCEEDED: _ClassVar[StatusCode]
    NOT_FOUND: _ClassVar[StatusCode]
    ALREADY_EXISTS: _ClassVar[StatusCode]
    PERMISSION_DENIED: _ClassVar[StatusCode]
    RESOURCE_EXHAUSTED: _ClassVar[StatusCode]
    FAILED_PRECONDITION: _ClassVar[StatusCode]
    ABORTED: _ClassVar[StatusCode]
    OUT_OF_RANGE: _ClassVar[StatusCode]
    UNIMPLEMENTED: _ClassVar[StatusCode]
    INTERNAL: _ClassVar[StatusCode]
    UNAVAILABLE: _ClassVar[StatusCode]
    DATA_LOSS: _ClassVar[StatusCode]
    UNAUTHENTICATED: _ClassVar[StatusCode]

class CancelReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CANCEL_REASON_UNSPECIFIED: _ClassVar[CancelReason]
    CANCEL_REASON_CLIENT: _ClassVar[CancelReason]
    CANCEL_REASON_DEADLINE: _ClassVar[CancelReason]
    CANCEL_REASON_STREAM_CLOSED: _ClassVar[CancelReason]
    CANCEL_REASON_FAILED: _ClassVar[CancelReason]

class ServingState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_STATE_UNSPECIFIED: _ClassVar[ServingState]
    STATE_LOADING: _ClassVar[ServingState]
    STATE_SERVING: _ClassVar[ServingState]
    STATE_DRAINING: _ClassVar[ServingState]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class JsonLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JSON_LAYOUT_FREE_WHITESPACE: _ClassVar[JsonLayout]
    JSON_LAYOUT_COMPACT: _ClassVar[JsonLayout]
DTYPE_UNSPECIFIED: DType
DTYPE_FP32: DType
DTYPE_FP16: DType
DTYPE_BF16: DType
OK: StatusCode
CANCELLED: StatusCode
UNKNOWN: StatusCode
INVALID_ARGUMENT: StatusCode
DEADLINE_EXCEEDED: StatusCode
NOT_FOUND: StatusCode
ALREADY_EXISTS: StatusCode
PERMISSION_DENIED: StatusCode
RESOURCE_EXHAUSTED: StatusCode
FAILED_PRECONDITION: StatusCode
ABORTED: StatusCode
OUT_OF_RANGE: StatusCode
UNIMPLEMENTED: StatusCode
INTERNAL: StatusCode
UNAVAILABLE: StatusCode
DATA_LOSS: StatusCode
UNAUTHENTICATED: StatusCode
CANCEL_REASON_UNSPECIFIED: CancelReason
CANCEL_REASON_CLIENT: CancelReason
CANCEL_REASON_DEADLINE: CancelReason
CANCEL_REASON_STREAM_CLOSED: CancelReason
CANCEL_REASON_FAILED: CancelReason
SERVING_STATE_UNSPECIFIED: ServingState
STATE_LOADING: ServingState
STATE_SERVING: ServingState
STATE_DRAINING: ServingState
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
JSON_LAYOUT_FREE_WHITESPACE: JsonLayout
JSON_LAYOUT_COMPACT: JsonLayout

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: StatusCode
    message: str
    def __init__(self, code: _Optional[_Union[StatusCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: CancelReason
    def __init__(self, reason: _Optional[_Union[CancelReason, str]] = ...) -> None: ...

class LayerExperts(_message.Message):
    __slots__ = ("layer", "experts")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("fingerprint", "architecture", "hidden_size", "num_layers", "moe_layers", "num_experts", "top_k", "moe_intermediate_size", "bits")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MOE_INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    architecture: str
    hidden_size: int
    num_layers: int
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    bits: float
    def __init__(self, fingerprint: _Optional[str] = ..., architecture: _Optional[str] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., moe_layers: _Optional[_Iterable[int]] = ..., num_experts: _Optional[int] = ..., top_k: _Optional[int] = ..., moe_intermediate_size: _Optional[int] = ..., bits: _Optional[float] = ...) -> None: ...

class Versions(_message.Message):
    __slots__ = ("server", "protocol", "grpc", "git")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    GRPC_FIELD_NUMBER: _ClassVar[int]
    GIT_FIELD_NUMBER: _ClassVar[int]
    server: str
    protocol: str
    grpc: str
    git: str
    def __init__(self, server: _Optional[str] = ..., protocol: _Optional[str] = ..., grpc: _Optional[str] = ..., git: _Optional[str] = ...) -> None: ...

class ExpertRequest(_message.Message):
    __slots__ = ("id", "layer", "hidden", "slots", "expert_ids", "expert_weights", "output_dtype", "timeout_us", "shared_expert", "cancel", "shm_offer")
    ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    SHARED_EXPERT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFER_FIELD_NUMBER: _ClassVar[int]
    id: int
    layer: int
    hidden: Tensor
    slots: int
    expert_ids: _containers.RepeatedScalarFieldContainer[int]
    expert_weights: _containers.RepeatedScalarFieldContainer[float]
    output_dtype: DType
    timeout_us: int
    shared_expert: bool
    cancel: Cancel
    shm_offer: SharedMemoryOffer
    def __init__(self, id: _Optional[int] = ..., layer: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., slots: _Optional[int] = ..., expert_ids: _Optional[_Iterable[int]] = ..., expert_weights: _Optional[_Iterable[float]] = ..., output_dtype: _Optional[_Union[DType, str]] = ..., timeout_us: _Optional[int] = ..., shared_expert: _Optional[bool] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., shm_offer: _Optional[_Union[SharedMemoryOffer, _Mapping]] = ...) -> None: ...

class SharedMemoryOffer(_message.Message):
    __slots__ = ("name", "nonce")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    nonce: int
    def __init__(self, name: _Optional[str] = ..., nonce: _Optional[int] = ...) -> None: ...

class WorkerTimings(_message.Message):
    __slots__ = ("queue_us", "compute_us", "total_us", "batch_tokens", "batch_requests", "chunks")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    compute_us: int
    total_us: int
    batch_tokens: int
    batch_requests: int
    chunks: int
    def __init__(self, queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., total_us: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., batch_requests: _Optional[int] = ..., chunks: _Optional[int] = ...) -> None: ...

class ExpertResponse(_message.Message):
    __slots__ = ("id", "layer", "status", "output", "timings", "shm_attached")
    ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    SHM_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    id: int
    layer: int
    status: RequestStatus
    output: Tensor
    timings: WorkerTimings
    shm_attached: bool
    def __init__(self, id: _Optional[int] = ..., layer: _Optional[int] = ..., status: _Optional[_Union[RequestStatus, _Mapping]] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., timings: _Optional[_Union[WorkerTimings, _Mapping]] = ..., shm_attached: _Optional[bool] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model", "experts", "worker_name", "backend", "device", "pinned_bytes", "versions", "state", "max_message_bytes", "max_batch_tokens", "long_prefill_token_threshold", "max_queue", "cancel_supported", "holds_shared_expert", "shm_supported", "host_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LONG_PREFILL_TOKEN_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    HOLDS_SHARED_EXPERT_FIELD_NUMBER: _ClassVar[int]
    SHM_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    model: ModelIdentity
    experts: _containers.RepeatedCompositeFieldContainer[LayerExperts]
    worker_name: str
    backend: str
    device: str
    pinned_bytes: int
    versions: Versions
    state: ServingState
    max_message_bytes: int
    max_batch_tokens: int
    long_prefill_token_threshold: int
    max_queue: int
    cancel_supported: bool
    holds_shared_expert: bool
    shm_supported: bool
    host_id: str
    def __init__(self, model: _Optional[_Union[ModelIdentity, _Mapping]] = ..., experts: _Optional[_Iterable[_Union[LayerExperts, _Mapping]]] = ..., worker_name: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., pinned_bytes: _Optional[int] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., state: _Optional[_Union[ServingState, str]] = ..., max_message_bytes: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., long_prefill_token_threshold: _Optional[int] = ..., max_queue: _Optional[int] = ..., cancel_supported: _Optional[bool] = ..., holds_shared_expert: _Optional[bool] = ..., shm_supported: _Optional[bool] = ..., host_id: _Optional[str] = ...) -> None: ...

class TopK(_message.Message):
    __slots__ = ("k", "ids", "weights")
    K_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    k: int
    ids: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, k: _Optional[int] = ..., ids: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class MoeLayerRequest(_message.Message):
    __slots__ = ("id", "layer", "hidden", "router_logits", "topk", "token_ids", "output_dtype", "timeout_us", "include_shared_expert", "cancel")
    ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ROUTER_LOGITS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SHARED_EXPERT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    id: int
    layer: int
    hidden: Tensor
    router_logits: Tensor
    topk: TopK
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_dtype: DType
    timeout_us: int
    include_shared_expert: bool
    cancel: Cancel
    def __init__(self, id: _Optional[int] = ..., layer: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., router_logits: _Optional[_Union[Tensor, _Mapping]] = ..., topk: _Optional[_Union[TopK, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., output_dtype: _Optional[_Union[DType, str]] = ..., timeout_us: _Optional[int] = ..., include_shared_expert: _Optional[bool] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class RouterTimings(_message.Message):
    __slots__ = ("gate_us", "dispatch_us", "workers_us", "combine_us", "total_us", "fanout")
    GATE_US_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_US_FIELD_NUMBER: _ClassVar[int]
    WORKERS_US_FIELD_NUMBER: _ClassVar[int]
    COMBINE_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    FANOUT_FIELD_NUMBER: _ClassVar[int]
    gate_us: int
    dispatch_us: int
    workers_us: int
    combine_us: int
    total_us: int
    fanout: int
    def __init__(self, gate_us: _Optional[int] = ..., dispatch_us: _Optional[int] = ..., workers_us: _Optional[int] = ..., combine_us: _Optional[int] = ..., total_us: _Optional[int] = ..., fanout: _Optional[int] = ...) -> None: ...

class MoeLayerResponse(_message.Message):
    __slots__ = ("id", "layer", "status", "output", "topk", "timings")
    ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    id: int
    layer: int
    status: RequestStatus
    output: Tensor
    topk: TopK
    timings: RouterTimings
    def __init__(self, id: _Optional[int] = ..., layer: _Optional[int] = ..., status: _Optional[_Union[RequestStatus, _Mapping]] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., topk: _Optional[_Union[TopK, _Mapping]] = ..., timings: _Optional[_Union[RouterTimings, _Mapping]] = ...) -> None: ...

class RouterDescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("name", "address", "up", "experts", "backend", "device", "shared_expert", "transport")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHARED_EXPERT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    up: bool
    experts: _containers.RepeatedCompositeFieldContainer[LayerExperts]
    backend: str
    device: str
    shared_expert: bool
    transport: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., up: _Optional[bool] = ..., experts: _Optional[_Iterable[_Union[LayerExperts, _Mapping]]] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., shared_expert: _Optional[bool] = ..., transport: _Optional[str] = ...) -> None: ...

class RouterDescribeResponse(_message.Message):
    __slots__ = ("model", "workers", "unserved_experts", "versions", "state", "cancel_supported", "shared_expert")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    UNSERVED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    SHARED_EXPERT_FIELD_NUMBER: _ClassVar[int]
    model: ModelIdentity
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    unserved_experts: int
    versions: Versions
    state: ServingState
    cancel_supported: bool
    shared_expert: str
    def __init__(self, model: _Optional[_Union[ModelIdentity, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., unserved_experts: _Optional[int] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., state: _Optional[_Union[ServingState, str]] = ..., cancel_supported: _Optional[bool] = ..., shared_expert: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logprobs", "logit_bias", "json_schema", "json_object", "regex", "grammar", "choice", "tagged_json", "structural_tag", "constraint_after_reasoning")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    TAGGED_JSON_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_AFTER_REASONING_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: ChoiceConstraint
    tagged_json: TaggedJsonConstraint
    structural_tag: StructuralTagConstraint
    constraint_after_reasoning: ReasoningBlock
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[ChoiceConstraint, _Mapping]] = ..., tagged_json: _Optional[_Union[TaggedJsonConstraint, _Mapping]] = ..., structural_tag: _Optional[_Union[StructuralTagConstraint, _Mapping]] = ..., constraint_after_reasoning: _Optional[_Union[ReasoningBlock, _Mapping]] = ...) -> None: ...

class StructuralTagConstraint(_message.Message):
    __slots__ = ("json", "json_layout")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_layout: JsonLayout
    def __init__(self, json: _Optional[str] = ..., json_layout: _Optional[_Union[JsonLayout, str]] = ...) -> None: ...

class ReasoningBlock(_message.Message):
    __slots__ = ("start", "end", "output_starts_inside")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_STARTS_INSIDE_FIELD_NUMBER: _ClassVar[int]
    start: str
    end: str
    output_starts_inside: bool
    def __init__(self, start: _Optional[str] = ..., end: _Optional[str] = ..., output_starts_inside: _Optional[bool] = ...) -> None: ...

class ChoiceConstraint(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TaggedJson(_message.Message):
    __slots__ = ("begin", "json_schema", "end")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    begin: str
    json_schema: str
    end: str
    def __init__(self, begin: _Optional[str] = ..., json_schema: _Optional[str] = ..., end: _Optional[str] = ...) -> None: ...

class TaggedJsonConstraint(_message.Message):
    __slots__ = ("alternatives",)
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    alternatives: _containers.RepeatedCompositeFieldContainer[TaggedJson]
    def __init__(self, alternatives: _Optional[_Iterable[_Union[TaggedJson, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "timeout_us", "prompt_logprobs", "num_speculative_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    timeout_us: int
    prompt_logprobs: int
    num_speculative_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., timeout_us: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GeneratedToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateTimings(_message.Message):
    __slots__ = ("queue_seconds", "prefill_seconds", "first_token_seconds", "mean_inter_token_seconds", "total_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_INTER_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    prefill_seconds: float
    first_token_seconds: float
    mean_inter_token_seconds: float
    total_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., first_token_seconds: _Optional[float] = ..., mean_inter_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "finish_reason", "usage", "timings", "prompt_logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[GeneratedToken]
    finish_reason: FinishReason
    usage: Usage
    timings: GenerateTimings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[GeneratedToken]
    def __init__(self, tokens: _Optional[_Iterable[_Union[GeneratedToken, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[GenerateTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[GeneratedToken, _Mapping]]] = ...) -> None: ...

class CancelGenerate(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateAction(_message.Message):
    __slots__ = ("stream_id", "start", "cancel")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    start: GenerateRequest
    cancel: CancelGenerate
    def __init__(self, stream_id: _Optional[int] = ..., start: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelGenerate, _Mapping]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("actions",)
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    actions: _containers.RepeatedCompositeFieldContainer[GenerateAction]
    def __init__(self, actions: _Optional[_Iterable[_Union[GenerateAction, _Mapping]]] = ...) -> None: ...

class GenerateUpdate(_message.Message):
    __slots__ = ("stream_id", "response", "last", "status_code", "status_message")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    response: GenerateResponse
    last: bool
    status_code: int
    status_message: str
    def __init__(self, stream_id: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., last: _Optional[bool] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[GenerateUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[GenerateUpdate, _Mapping]]] = ...) -> None: ...

class DescribeModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeModelResponse(_message.Message):
    __slots__ = ("model", "architecture", "vocab_size", "max_context", "eos_token_ids", "kv_capacity_tokens", "kv_block_size", "max_num_seqs", "experts", "versions", "state")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_capacity_tokens: int
    kv_block_size: int
    max_num_seqs: int
    experts: str
    versions: Versions
    state: ServingState
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., kv_capacity_tokens: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., experts: _Optional[str] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., state: _Optional[_Union[ServingState, str]] = ...) -> None: ...

class EngineStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStatsResponse(_message.Message):
    __slots__ = ("num_requests_running", "num_requests_waiting", "kv_cache_usage", "num_preemptions", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "num_speculative_tokens", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos")
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_speculative_tokens: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ...) -> None: ...
