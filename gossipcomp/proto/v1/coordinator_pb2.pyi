from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScheduleGroup(_message.Message):
    __slots__ = ("names", "compressor")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSOR_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    compressor: str
    def __init__(self, names: _Optional[_Iterable[str]] = ..., compressor: _Optional[str] = ...) -> None: ...

class Schedule(_message.Message):
    __slots__ = ("epoch", "effective_round", "planner", "groups", "links", "budget_s", "members")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_ROUND_FIELD_NUMBER: _ClassVar[int]
    PLANNER_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    effective_round: int
    planner: str
    groups: _containers.RepeatedCompositeFieldContainer[ScheduleGroup]
    links: _containers.RepeatedCompositeFieldContainer[LinkLevel]
    budget_s: float
    members: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., effective_round: _Optional[int] = ..., planner: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[ScheduleGroup, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkLevel, _Mapping]]] = ..., budget_s: _Optional[float] = ..., members: _Optional[_Iterable[int]] = ...) -> None: ...

class LinkLevel(_message.Message):
    __slots__ = ("low", "high", "level")
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    low: int
    high: int
    level: int
    def __init__(self, low: _Optional[int] = ..., high: _Optional[int] = ..., level: _Optional[int] = ...) -> None: ...

class LevelCost(_message.Message):
    __slots__ = ("level", "bytes_per_round")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    level: int
    bytes_per_round: int
    def __init__(self, level: _Optional[int] = ..., bytes_per_round: _Optional[int] = ...) -> None: ...

class TensorSize(_message.Message):
    __slots__ = ("name", "numel")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    numel: int
    def __init__(self, name: _Optional[str] = ..., numel: _Optional[int] = ...) -> None: ...

class LinkSamples(_message.Message):
    __slots__ = ("neighbour", "bytes", "seconds")
    NEIGHBOUR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    neighbour: int
    bytes: _containers.RepeatedScalarFieldContainer[int]
    seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, neighbour: _Optional[int] = ..., bytes: _Optional[_Iterable[int]] = ..., seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class PeerReport(_message.Message):
    __slots__ = ("protocol_version", "sender", "topology_hash", "model_signature", "round", "schedule_epoch", "compute_seconds", "compressor_fixed_seconds", "compressor_element_seconds", "compressor", "tensors", "links", "sends", "level_costs", "exchanges_per_round", "critical", "joining", "refused_epoch", "late_epoch", "initial_loss", "loss")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSOR_FIXED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSOR_ELEMENT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSOR_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    SENDS_FIELD_NUMBER: _ClassVar[int]
    LEVEL_COSTS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    CRITICAL_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    REFUSED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LATE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    INITIAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    sender: int
    topology_hash: str
    model_signature: str
    round: int
    schedule_epoch: int
    compute_seconds: float
    compressor_fixed_seconds: float
    compressor_element_seconds: float
    compressor: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSize]
    links: _containers.RepeatedCompositeFieldContainer[LinkSamples]
    sends: _containers.RepeatedCompositeFieldContainer[LinkSamples]
    level_costs: _containers.RepeatedCompositeFieldContainer[LevelCost]
    exchanges_per_round: int
    critical: bool
    joining: bool
    refused_epoch: int
    late_epoch: int
    initial_loss: float
    loss: float
    def __init__(self, protocol_version: _Optional[int] = ..., sender: _Optional[int] = ..., topology_hash: _Optional[str] = ..., model_signature: _Optional[str] = ..., round: _Optional[int] = ..., schedule_epoch: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., compressor_fixed_seconds: _Optional[float] = ..., compressor_element_seconds: _Optional[float] = ..., compressor: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSize, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkSamples, _Mapping]]] = ..., sends: _Optional[_Iterable[_Union[LinkSamples, _Mapping]]] = ..., level_costs: _Optional[_Iterable[_Union[LevelCost, _Mapping]]] = ..., exchanges_per_round: _Optional[int] = ..., critical: _Optional[bool] = ..., joining: _Optional[bool] = ..., refused_epoch: _Optional[int] = ..., late_epoch: _Optional[int] = ..., initial_loss: _Optional[float] = ..., loss: _Optional[float] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("has_schedule", "schedule", "earlier")
    HAS_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    EARLIER_FIELD_NUMBER: _ClassVar[int]
    has_schedule: bool
    schedule: Schedule
    earlier: _containers.RepeatedCompositeFieldContainer[Schedule]
    def __init__(self, has_schedule: _Optional[bool] = ..., schedule: _Optional[_Union[Schedule, _Mapping]] = ..., earlier: _Optional[_Iterable[_Union[Schedule, _Mapping]]] = ...) -> None: ...
