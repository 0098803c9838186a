from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("encoding", "raw", "encoded")
    class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RAW: _ClassVar[Image.Encoding]
        JPEG: _ClassVar[Image.Encoding]
        PNG: _ClassVar[Image.Encoding]
    RAW: Image.Encoding
    JPEG: Image.Encoding
    PNG: Image.Encoding
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    encoding: Image.Encoding
    raw: Tensor
    encoded: bytes
    def __init__(self, encoding: _Optional[_Union[Image.Encoding, str]] = ..., raw: _Optional[_Union[Tensor, _Mapping]] = ..., encoded: _Optional[bytes] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("state", "cameras", "instruction")
    class CamerasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Image
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    CAMERAS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    state: Tensor
    cameras: _containers.MessageMap[str, Image]
    instruction: str
    def __init__(self, state: _Optional[_Union[Tensor, _Mapping]] = ..., cameras: _Optional[_Mapping[str, Image]] = ..., instruction: _Optional[str] = ...) -> None: ...

class ActRequest(_message.Message):
    __slots__ = ("model_id", "request_id", "observation", "seed", "noise", "timeout_ms", "inference_delay", "queued_actions")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NOISE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_DELAY_FIELD_NUMBER: _ClassVar[int]
    QUEUED_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    request_id: str
    observation: Observation
    seed: int
    noise: Tensor
    timeout_ms: int
    inference_delay: int
    queued_actions: Tensor
    def __init__(self, model_id: _Optional[str] = ..., request_id: _Optional[str] = ..., observation: _Optional[_Union[Observation, _Mapping]] = ..., seed: _Optional[int] = ..., noise: _Optional[_Union[Tensor, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., inference_delay: _Optional[int] = ..., queued_actions: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RTCApplied(_message.Message):
    __slots__ = ("mode", "inference_delay", "queued", "execution_horizon", "max_guidance_weight")
    MODE_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_DELAY_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_HORIZON_FIELD_NUMBER: _ClassVar[int]
    MAX_GUIDANCE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    mode: str
    inference_delay: int
    queued: int
    execution_horizon: int
    max_guidance_weight: float
    def __init__(self, mode: _Optional[str] = ..., inference_delay: _Optional[int] = ..., queued: _Optional[int] = ..., execution_horizon: _Optional[int] = ..., max_guidance_weight: _Optional[float] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_us", "decode_us", "inference_us", "total_us", "prefix_us", "denoise_us", "batch_us", "wake_us", "encode_us")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    DECODE_US_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    PREFIX_US_FIELD_NUMBER: _ClassVar[int]
    DENOISE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_US_FIELD_NUMBER: _ClassVar[int]
    WAKE_US_FIELD_NUMBER: _ClassVar[int]
    ENCODE_US_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    decode_us: int
    inference_us: int
    total_us: int
    prefix_us: int
    denoise_us: int
    batch_us: int
    wake_us: int
    encode_us: int
    def __init__(self, queue_us: _Optional[int] = ..., decode_us: _Optional[int] = ..., inference_us: _Optional[int] = ..., total_us: _Optional[int] = ..., prefix_us: _Optional[int] = ..., denoise_us: _Optional[int] = ..., batch_us: _Optional[int] = ..., wake_us: _Optional[int] = ..., encode_us: _Optional[int] = ...) -> None: ...

class ActError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ActResponse(_message.Message):
    __slots__ = ("request_id", "model_id", "actions", "commit", "timing", "batch_size", "seed", "explicit_noise", "n_exec", "error", "uncertainty", "uncertainty_kind", "rtc", "failure", "failure_alarm")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_NOISE_FIELD_NUMBER: _ClassVar[int]
    N_EXEC_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    UNCERTAINTY_FIELD_NUMBER: _ClassVar[int]
    UNCERTAINTY_KIND_FIELD_NUMBER: _ClassVar[int]
    RTC_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_ALARM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    actions: Tensor
    commit: str
    timing: Timing
    batch_size: int
    seed: int
    explicit_noise: bool
    n_exec: int
    error: ActError
    uncertainty: float
    uncertainty_kind: str
    rtc: RTCApplied
    failure: float
    failure_alarm: bool
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., actions: _Optional[_Union[Tensor, _Mapping]] = ..., commit: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., batch_size: _Optional[int] = ..., seed: _Optional[int] = ..., explicit_noise: _Optional[bool] = ..., n_exec: _Optional[int] = ..., error: _Optional[_Union[ActError, _Mapping]] = ..., uncertainty: _Optional[float] = ..., uncertainty_kind: _Optional[str] = ..., rtc: _Optional[_Union[RTCApplied, _Mapping]] = ..., failure: _Optional[float] = ..., failure_alarm: _Optional[bool] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "ref", "commit", "previous_commit", "staged_commit", "followed_ref", "robot_spec_json", "chunk_len", "n_exec", "control_hz", "policy_type", "device", "last_load_error", "served", "batches", "dropped_expired", "rejected_full", "max_batch", "max_wait_us", "max_queue", "adaptive_wait", "active_clients", "latency_p50_ms", "latency_p99_ms", "requests_per_s", "rtc_mode", "rtc_max_delay")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_COMMIT_FIELD_NUMBER: _ClassVar[int]
    STAGED_COMMIT_FIELD_NUMBER: _ClassVar[int]
    FOLLOWED_REF_FIELD_NUMBER: _ClassVar[int]
    ROBOT_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LEN_FIELD_NUMBER: _ClassVar[int]
    N_EXEC_FIELD_NUMBER: _ClassVar[int]
    CONTROL_HZ_FIELD_NUMBER: _ClassVar[int]
    POLICY_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LAST_LOAD_ERROR_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FULL_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_WAIT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P50_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P99_MS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_S_FIELD_NUMBER: _ClassVar[int]
    RTC_MODE_FIELD_NUMBER: _ClassVar[int]
    RTC_MAX_DELAY_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    ref: str
    commit: str
    previous_commit: str
    staged_commit: str
    followed_ref: str
    robot_spec_json: str
    chunk_len: int
    n_exec: int
    control_hz: float
    policy_type: str
    device: str
    last_load_error: str
    served: int
    batches: int
    dropped_expired: int
    rejected_full: int
    max_batch: int
    max_wait_us: int
    max_queue: int
    adaptive_wait: bool
    active_clients: int
    latency_p50_ms: float
    latency_p99_ms: float
    requests_per_s: float
    rtc_mode: str
    rtc_max_delay: int
    def __init__(self, model_id: _Optional[str] = ..., ref: _Optional[str] = ..., commit: _Optional[str] = ..., previous_commit: _Optional[str] = ..., staged_commit: _Optional[str] = ..., followed_ref: _Optional[str] = ..., robot_spec_json: _Optional[str] = ..., chunk_len: _Optional[int] = ..., n_exec: _Optional[int] = ..., control_hz: _Optional[float] = ..., policy_type: _Optional[str] = ..., device: _Optional[str] = ..., last_load_error: _Optional[str] = ..., served: _Optional[int] = ..., batches: _Optional[int] = ..., dropped_expired: _Optional[int] = ..., rejected_full: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_wait_us: _Optional[int] = ..., max_queue: _Optional[int] = ..., adaptive_wait: _Optional[bool] = ..., active_clients: _Optional[int] = ..., latency_p50_ms: _Optional[float] = ..., latency_p99_ms: _Optional[float] = ..., requests_per_s: _Optional[float] = ..., rtc_mode: _Optional[str] = ..., rtc_max_delay: _Optional[int] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("models", "server_version", "max_request_bytes")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    server_version: str
    max_request_bytes: int
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., server_version: _Optional[str] = ..., max_request_bytes: _Optional[int] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("model_id", "ref", "force", "stage_only")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    STAGE_ONLY_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    ref: str
    force: bool
    stage_only: bool
    def __init__(self, model_id: _Optional[str] = ..., ref: _Optional[str] = ..., force: _Optional[bool] = ..., stage_only: _Optional[bool] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("model_id", "commit", "previous_commit", "serving", "load_us")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_COMMIT_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    LOAD_US_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    commit: str
    previous_commit: str
    serving: bool
    load_us: int
    def __init__(self, model_id: _Optional[str] = ..., commit: _Optional[str] = ..., previous_commit: _Optional[str] = ..., serving: _Optional[bool] = ..., load_us: _Optional[int] = ...) -> None: ...

class ModelRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class SwapResponse(_message.Message):
    __slots__ = ("model_id", "commit", "previous_commit")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_COMMIT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    commit: str
    previous_commit: str
    def __init__(self, model_id: _Optional[str] = ..., commit: _Optional[str] = ..., previous_commit: _Optional[str] = ...) -> None: ...
