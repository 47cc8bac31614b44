from gossipcomp.proto.v1 import coordinator_pb2 as _coordinator_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "codec", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class SenderProof(_message.Message):
    __slots__ = ("key_id", "timestamp_ms", "nonce", "receiver", "content_sha256", "signature")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    CONTENT_SHA256_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    key_id: bytes
    timestamp_ms: int
    nonce: bytes
    receiver: int
    content_sha256: bytes
    signature: bytes
    def __init__(self, key_id: _Optional[bytes] = ..., timestamp_ms: _Optional[int] = ..., nonce: _Optional[bytes] = ..., receiver: _Optional[int] = ..., content_sha256: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class LevelNotice(_message.Message):
    __slots__ = ("level", "effective_round")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_ROUND_FIELD_NUMBER: _ClassVar[int]
    level: int
    effective_round: int
    def __init__(self, level: _Optional[int] = ..., effective_round: _Optional[int] = ...) -> None: ...

class EnvelopeHeader(_message.Message):
    __slots__ = ("protocol_version", "sender", "round", "phase", "schedule_epoch", "tensors", "proof", "level_notice")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    LEVEL_NOTICE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    sender: int
    round: int
    phase: str
    schedule_epoch: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    proof: SenderProof
    level_notice: LevelNotice
    def __init__(self, protocol_version: _Optional[int] = ..., sender: _Optional[int] = ..., round: _Optional[int] = ..., phase: _Optional[str] = ..., schedule_epoch: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ..., proof: _Optional[_Union[SenderProof, _Mapping]] = ..., level_notice: _Optional[_Union[LevelNotice, _Mapping]] = ...) -> None: ...

class EnvelopeChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: EnvelopeHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[EnvelopeHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ...) -> None: ...

class BulkTicket(_message.Message):
    __slots__ = ("ticket", "port")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    port: int
    def __init__(self, ticket: _Optional[bytes] = ..., port: _Optional[int] = ...) -> None: ...

class BulkReply(_message.Message):
    __slots__ = ("ticket", "done")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ticket: BulkTicket
    done: PushReply
    def __init__(self, ticket: _Optional[_Union[BulkTicket, _Mapping]] = ..., done: _Optional[_Union[PushReply, _Mapping]] = ...) -> None: ...

class LinkReply(_message.Message):
    __slots__ = ("received_bytes", "status", "details")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    status: int
    details: str
    def __init__(self, received_bytes: _Optional[int] = ..., status: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("protocol_version", "sender", "topology_hash", "model_signature", "proof", "round", "proposed_resume_round", "alone", "schedule_epoch")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_RESUME_ROUND_FIELD_NUMBER: _ClassVar[int]
    ALONE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    sender: int
    topology_hash: str
    model_signature: str
    proof: SenderProof
    round: int
    proposed_resume_round: int
    alone: bool
    schedule_epoch: int
    def __init__(self, protocol_version: _Optional[int] = ..., sender: _Optional[int] = ..., topology_hash: _Optional[str] = ..., model_signature: _Optional[str] = ..., proof: _Optional[_Union[SenderProof, _Mapping]] = ..., round: _Optional[int] = ..., proposed_resume_round: _Optional[int] = ..., alone: _Optional[bool] = ..., schedule_epoch: _Optional[int] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("protocol_version", "receiver", "topology_hash", "model_signature", "proof", "round", "resume_round", "alone", "schedule_epoch")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RESUME_ROUND_FIELD_NUMBER: _ClassVar[int]
    ALONE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    receiver: int
    topology_hash: str
    model_signature: str
    proof: SenderProof
    round: int
    resume_round: int
    alone: bool
    schedule_epoch: int
    def __init__(self, protocol_version: _Optional[int] = ..., receiver: _Optional[int] = ..., topology_hash: _Optional[str] = ..., model_signature: _Optional[str] = ..., proof: _Optional[_Union[SenderProof, _Mapping]] = ..., round: _Optional[int] = ..., resume_round: _Optional[int] = ..., alone: _Optional[bool] = ..., schedule_epoch: _Optional[int] = ...) -> None: ...

class ScheduleList(_message.Message):
    __slots__ = ("schedules",)
    SCHEDULES_FIELD_NUMBER: _ClassVar[int]
    schedules: _containers.RepeatedCompositeFieldContainer[_coordinator_pb2.Schedule]
    def __init__(self, schedules: _Optional[_Iterable[_Union[_coordinator_pb2.Schedule, _Mapping]]] = ...) -> None: ...
