from . import policy_service_pb2 as _policy_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SegmentKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEGMENT_KIND_UNSPECIFIED: _ClassVar[SegmentKind]
    AUTONOMOUS: _ClassVar[SegmentKind]
    INTERVENTION: _ClassVar[SegmentKind]
    RESET: _ClassVar[SegmentKind]

class Controller(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY: _ClassVar[Controller]
    HUMAN: _ClassVar[Controller]
    SCRIPTED: _ClassVar[Controller]
SEGMENT_KIND_UNSPECIFIED: SegmentKind
AUTONOMOUS: SegmentKind
INTERVENTION: SegmentKind
RESET: SegmentKind
POLICY: Controller
HUMAN: Controller
SCRIPTED: Controller

class Hello(_message.Message):
    __slots__ = ("robot_id", "task", "robot_spec_json", "client_version")
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    ROBOT_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    task: str
    robot_spec_json: str
    client_version: str
    def __init__(self, robot_id: _Optional[str] = ..., task: _Optional[str] = ..., robot_spec_json: _Optional[str] = ..., client_version: _Optional[str] = ...) -> None: ...

class StartEpisode(_message.Message):
    __slots__ = ("episode_id", "instruction")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    instruction: str
    def __init__(self, episode_id: _Optional[str] = ..., instruction: _Optional[str] = ...) -> None: ...

class FrameBatch(_message.Message):
    __slots__ = ("episode_id", "seq", "cameras", "state", "action", "proposed_action", "reward", "terminated", "truncated", "controller", "revision", "timestamp", "uncertainty", "failure")
    class CamerasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _policy_service_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_policy_service_pb2.Tensor, _Mapping]] = ...) -> None: ...
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CAMERAS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_ACTION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    UNCERTAINTY_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    seq: int
    cameras: _containers.MessageMap[str, _policy_service_pb2.Tensor]
    state: _policy_service_pb2.Tensor
    action: _policy_service_pb2.Tensor
    proposed_action: _policy_service_pb2.Tensor
    reward: _policy_service_pb2.Tensor
    terminated: _policy_service_pb2.Tensor
    truncated: _policy_service_pb2.Tensor
    controller: _policy_service_pb2.Tensor
    revision: _containers.RepeatedScalarFieldContainer[str]
    timestamp: _policy_service_pb2.Tensor
    uncertainty: _policy_service_pb2.Tensor
    failure: _policy_service_pb2.Tensor
    def __init__(self, episode_id: _Optional[str] = ..., seq: _Optional[int] = ..., cameras: _Optional[_Mapping[str, _policy_service_pb2.Tensor]] = ..., state: _Optional[_Union[_policy_service_pb2.Tensor, _Mapping]] = ..., action: _Optional[_Union[_policy_service_pb2.Tensor, _Mapping]] = ..., proposed_action: _Optional[_Union[_policy_service_pb2.Tensor, _Mapping]] = ..., reward: _Optional[_Union[_policy_service_pb2.Tensor, _Mapping]] = ..., terminated: _Optional[_Union[_policy_service_pb2.Tensor, _Mapping]] = ..., truncated: _Optional[_Union[_policy_service_pb2.Tensor, _Mapping]] = ..., controller: _Optional[_Union[_policy_service_pb2.Tensor, _Mapping]] = ..., revision: _Optional[_Iterable[str]] = ..., timestamp: _Optional[_Union[_policy_service_pb2.Tensor, _Mapping]] = ..., uncertainty: _Optional[_Union[_policy_service_pb2.Tensor, _Mapping]] = ..., failure: _Optional[_Union[_policy_service_pb2.Tensor, _Mapping]] = ...) -> None: ...

class SegmentMarker(_message.Message):
    __slots__ = ("episode_id", "index", "start", "kind", "controller", "reason")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    index: int
    start: int
    kind: SegmentKind
    controller: Controller
    reason: str
    def __init__(self, episode_id: _Optional[str] = ..., index: _Optional[int] = ..., start: _Optional[int] = ..., kind: _Optional[_Union[SegmentKind, str]] = ..., controller: _Optional[_Union[Controller, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class EndEpisode(_message.Message):
    __slots__ = ("episode_id", "length", "outcome", "success")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    length: int
    outcome: str
    success: bool
    def __init__(self, episode_id: _Optional[str] = ..., length: _Optional[int] = ..., outcome: _Optional[str] = ..., success: _Optional[bool] = ...) -> None: ...

class RobotMessage(_message.Message):
    __slots__ = ("msg_id", "hello", "start", "frames", "segment", "end")
    MSG_ID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    msg_id: int
    hello: Hello
    start: StartEpisode
    frames: FrameBatch
    segment: SegmentMarker
    end: EndEpisode
    def __init__(self, msg_id: _Optional[int] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., start: _Optional[_Union[StartEpisode, _Mapping]] = ..., frames: _Optional[_Union[FrameBatch, _Mapping]] = ..., segment: _Optional[_Union[SegmentMarker, _Mapping]] = ..., end: _Optional[_Union[EndEpisode, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("collector_version", "max_batch_frames", "max_message_bytes")
    COLLECTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    collector_version: str
    max_batch_frames: int
    max_message_bytes: int
    def __init__(self, collector_version: _Optional[str] = ..., max_batch_frames: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("msg_id", "episode_id", "committed", "segments", "ended", "closed", "duplicates")
    MSG_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    msg_id: int
    episode_id: str
    committed: int
    segments: int
    ended: bool
    closed: bool
    duplicates: int
    def __init__(self, msg_id: _Optional[int] = ..., episode_id: _Optional[str] = ..., committed: _Optional[int] = ..., segments: _Optional[int] = ..., ended: _Optional[bool] = ..., closed: _Optional[bool] = ..., duplicates: _Optional[int] = ...) -> None: ...

class Reject(_message.Message):
    __slots__ = ("msg_id", "episode_id", "code", "message")
    MSG_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    msg_id: int
    episode_id: str
    code: int
    message: str
    def __init__(self, msg_id: _Optional[int] = ..., episode_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CollectorMessage(_message.Message):
    __slots__ = ("welcome", "ack", "reject")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    ack: Ack
    reject: Reject
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., reject: _Optional[_Union[Reject, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RobotStats(_message.Message):
    __slots__ = ("robot_id", "frames_received", "frames_committed", "frames_stored", "frames_rejected", "frames_duplicate", "episodes_closed", "connected")
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    FRAMES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_STORED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    EPISODES_CLOSED_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    frames_received: int
    frames_committed: int
    frames_stored: int
    frames_rejected: int
    frames_duplicate: int
    episodes_closed: int
    connected: bool
    def __init__(self, robot_id: _Optional[str] = ..., frames_received: _Optional[int] = ..., frames_committed: _Optional[int] = ..., frames_stored: _Optional[int] = ..., frames_rejected: _Optional[int] = ..., frames_duplicate: _Optional[int] = ..., episodes_closed: _Optional[int] = ..., connected: _Optional[bool] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("robots", "prometheus_text")
    ROBOTS_FIELD_NUMBER: _ClassVar[int]
    PROMETHEUS_TEXT_FIELD_NUMBER: _ClassVar[int]
    robots: _containers.RepeatedCompositeFieldContainer[RobotStats]
    prometheus_text: str
    def __init__(self, robots: _Optional[_Iterable[_Union[RobotStats, _Mapping]]] = ..., prometheus_text: _Optional[str] = ...) -> None: ...

class HelpAsk(_message.Message):
    __slots__ = ("robot_id", "episode_id", "reason", "urgency")
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    URGENCY_FIELD_NUMBER: _ClassVar[int]
    robot_id: str
    episode_id: str
    reason: str
    urgency: float
    def __init__(self, robot_id: _Optional[str] = ..., episode_id: _Optional[str] = ..., reason: _Optional[str] = ..., urgency: _Optional[float] = ...) -> None: ...

class HelpQuery(_message.Message):
    __slots__ = ("request_id", "withdraw")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WITHDRAW_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    withdraw: bool
    def __init__(self, request_id: _Optional[int] = ..., withdraw: _Optional[bool] = ...) -> None: ...

class HelpState(_message.Message):
    __slots__ = ("request_id", "status", "claimed_by", "claimed_at", "note", "robot_id", "episode_id", "urgency", "created_at")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_BY_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_AT_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    ROBOT_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    URGENCY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    status: str
    claimed_by: str
    claimed_at: float
    note: str
    robot_id: str
    episode_id: str
    urgency: float
    created_at: float
    def __init__(self, request_id: _Optional[int] = ..., status: _Optional[str] = ..., claimed_by: _Optional[str] = ..., claimed_at: _Optional[float] = ..., note: _Optional[str] = ..., robot_id: _Optional[str] = ..., episode_id: _Optional[str] = ..., urgency: _Optional[float] = ..., created_at: _Optional[float] = ...) -> None: ...

class HelpClaim(_message.Message):
    __slots__ = ("operator", "request_id")
    OPERATOR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    operator: str
    request_id: int
    def __init__(self, operator: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class HelpResolve(_message.Message):
    __slots__ = ("operator", "request_id", "note")
    OPERATOR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    operator: str
    request_id: int
    note: str
    def __init__(self, operator: _Optional[str] = ..., request_id: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...
