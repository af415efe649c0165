from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGENT_PHASE_UNSPECIFIED: _ClassVar[AgentPhase]
    AGENT_PHASE_IDLE: _ClassVar[AgentPhase]
    AGENT_PHASE_RUNNING: _ClassVar[AgentPhase]
    AGENT_PHASE_STOPPING: _ClassVar[AgentPhase]

class CheckpointProblemKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_PROBLEM_KIND_UNSPECIFIED: _ClassVar[CheckpointProblemKind]
    CHECKPOINT_PROBLEM_KIND_STALE_COMMIT: _ClassVar[CheckpointProblemKind]
    CHECKPOINT_PROBLEM_KIND_QUARANTINED: _ClassVar[CheckpointProblemKind]
    CHECKPOINT_PROBLEM_KIND_UNREACHABLE: _ClassVar[CheckpointProblemKind]
    CHECKPOINT_PROBLEM_KIND_SAVE_FAILED: _ClassVar[CheckpointProblemKind]
    CHECKPOINT_PROBLEM_KIND_FENCE_TIMEOUT: _ClassVar[CheckpointProblemKind]
    CHECKPOINT_PROBLEM_KIND_FOREIGN_LINEAGE: _ClassVar[CheckpointProblemKind]

class HangPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANG_PHASE_UNSPECIFIED: _ClassVar[HangPhase]
    HANG_PHASE_FIRST_STEP: _ClassVar[HangPhase]
    HANG_PHASE_STEP: _ClassVar[HangPhase]
    HANG_PHASE_CHECKPOINT: _ClassVar[HangPhase]

class Collective(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COLLECTIVE_UNSPECIFIED: _ClassVar[Collective]
    COLLECTIVE_ALL_REDUCE: _ClassVar[Collective]
    COLLECTIVE_ALL_GATHER: _ClassVar[Collective]
    COLLECTIVE_REDUCE_SCATTER: _ClassVar[Collective]

class OnNoCheckpoint(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ON_NO_CHECKPOINT_UNSPECIFIED: _ClassVar[OnNoCheckpoint]
    ON_NO_CHECKPOINT_FAIL: _ClassVar[OnNoCheckpoint]
    ON_NO_CHECKPOINT_FRESH_START: _ClassVar[OnNoCheckpoint]

class StragglerPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STRAGGLER_POLICY_UNSPECIFIED: _ClassVar[StragglerPolicy]
    STRAGGLER_POLICY_REPLACE: _ClassVar[StragglerPolicy]
    STRAGGLER_POLICY_EXCLUDE: _ClassVar[StragglerPolicy]
    STRAGGLER_POLICY_ALERT: _ClassVar[StragglerPolicy]

class Precision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECISION_UNSPECIFIED: _ClassVar[Precision]
    PRECISION_BF16: _ClassVar[Precision]
    PRECISION_FP32: _ClassVar[Precision]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_STARTING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_STOPPING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_CRASH: _ClassVar[EventKind]
    EVENT_KIND_HANG: _ClassVar[EventKind]
    EVENT_KIND_STRAGGLER: _ClassVar[EventKind]
    EVENT_KIND_NODE_LOST: _ClassVar[EventKind]
    EVENT_KIND_AGENT_RESTARTED: _ClassVar[EventKind]
    EVENT_KIND_REPLACED: _ClassVar[EventKind]
    EVENT_KIND_EXCLUDED: _ClassVar[EventKind]
    EVENT_KIND_CORDONED: _ClassVar[EventKind]
    EVENT_KIND_ALERT: _ClassVar[EventKind]
    EVENT_KIND_OPERATOR: _ClassVar[EventKind]
    EVENT_KIND_QUARANTINED: _ClassVar[EventKind]
    EVENT_KIND_CHECKPOINT_REFUSED: _ClassVar[EventKind]
    EVENT_KIND_CHECKPOINT_FAILED: _ClassVar[EventKind]
    EVENT_KIND_SUSPECTED: _ClassVar[EventKind]
    EVENT_KIND_FRESH_START: _ClassVar[EventKind]
    EVENT_KIND_STOP_TIMEOUT: _ClassVar[EventKind]

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_READY: _ClassVar[NodeState]
    NODE_STATE_CORDONED: _ClassVar[NodeState]
    NODE_STATE_DRAINING: _ClassVar[NodeState]
    NODE_STATE_DRAINED: _ClassVar[NodeState]

class NextGenerationAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NEXT_GENERATION_ACTION_UNSPECIFIED: _ClassVar[NextGenerationAction]
    NEXT_GENERATION_ACTION_WAIT: _ClassVar[NextGenerationAction]
    NEXT_GENERATION_ACTION_START: _ClassVar[NextGenerationAction]
    NEXT_GENERATION_ACTION_EXIT: _ClassVar[NextGenerationAction]

class FaultKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAULT_KIND_UNSPECIFIED: _ClassVar[FaultKind]
    FAULT_KIND_CRASH: _ClassVar[FaultKind]
    FAULT_KIND_KILL: _ClassVar[FaultKind]
    FAULT_KIND_HANG: _ClassVar[FaultKind]
    FAULT_KIND_SLOW: _ClassVar[FaultKind]
    FAULT_KIND_LOSE_NODE: _ClassVar[FaultKind]
    FAULT_KIND_KILL_LEADER: _ClassVar[FaultKind]
    FAULT_KIND_RESTART_ETCD: _ClassVar[FaultKind]
    FAULT_KIND_KILL_AGENT: _ClassVar[FaultKind]
    FAULT_KIND_TERM_AGENT: _ClassVar[FaultKind]
    FAULT_KIND_TERM_LEADER: _ClassVar[FaultKind]
    FAULT_KIND_STALL_LEADER: _ClassVar[FaultKind]
    FAULT_KIND_STALL_AGENT: _ClassVar[FaultKind]
    FAULT_KIND_STALL_NODE: _ClassVar[FaultKind]
    FAULT_KIND_PARTITION_NODE: _ClassVar[FaultKind]
AGENT_PHASE_UNSPECIFIED: AgentPhase
AGENT_PHASE_IDLE: AgentPhase
AGENT_PHASE_RUNNING: AgentPhase
AGENT_PHASE_STOPPING: AgentPhase
CHECKPOINT_PROBLEM_KIND_UNSPECIFIED: CheckpointProblemKind
CHECKPOINT_PROBLEM_KIND_STALE_COMMIT: CheckpointProblemKind
CHECKPOINT_PROBLEM_KIND_QUARANTINED: CheckpointProblemKind
CHECKPOINT_PROBLEM_KIND_UNREACHABLE: CheckpointProblemKind
CHECKPOINT_PROBLEM_KIND_SAVE_FAILED: CheckpointProblemKind
CHECKPOINT_PROBLEM_KIND_FENCE_TIMEOUT: CheckpointProblemKind
CHECKPOINT_PROBLEM_KIND_FOREIGN_LINEAGE: CheckpointProblemKind
HANG_PHASE_UNSPECIFIED: HangPhase
HANG_PHASE_FIRST_STEP: HangPhase
HANG_PHASE_STEP: HangPhase
HANG_PHASE_CHECKPOINT: HangPhase
COLLECTIVE_UNSPECIFIED: Collective
COLLECTIVE_ALL_REDUCE: Collective
COLLECTIVE_ALL_GATHER: Collective
COLLECTIVE_REDUCE_SCATTER: Collective
ON_NO_CHECKPOINT_UNSPECIFIED: OnNoCheckpoint
ON_NO_CHECKPOINT_FAIL: OnNoCheckpoint
ON_NO_CHECKPOINT_FRESH_START: OnNoCheckpoint
STRAGGLER_POLICY_UNSPECIFIED: StragglerPolicy
STRAGGLER_POLICY_REPLACE: StragglerPolicy
STRAGGLER_POLICY_EXCLUDE: StragglerPolicy
STRAGGLER_POLICY_ALERT: StragglerPolicy
PRECISION_UNSPECIFIED: Precision
PRECISION_BF16: Precision
PRECISION_FP32: Precision
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_STARTING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_STOPPING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_CRASH: EventKind
EVENT_KIND_HANG: EventKind
EVENT_KIND_STRAGGLER: EventKind
EVENT_KIND_NODE_LOST: EventKind
EVENT_KIND_AGENT_RESTARTED: EventKind
EVENT_KIND_REPLACED: EventKind
EVENT_KIND_EXCLUDED: EventKind
EVENT_KIND_CORDONED: EventKind
EVENT_KIND_ALERT: EventKind
EVENT_KIND_OPERATOR: EventKind
EVENT_KIND_QUARANTINED: EventKind
EVENT_KIND_CHECKPOINT_REFUSED: EventKind
EVENT_KIND_CHECKPOINT_FAILED: EventKind
EVENT_KIND_SUSPECTED: EventKind
EVENT_KIND_FRESH_START: EventKind
EVENT_KIND_STOP_TIMEOUT: EventKind
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_READY: NodeState
NODE_STATE_CORDONED: NodeState
NODE_STATE_DRAINING: NodeState
NODE_STATE_DRAINED: NodeState
NEXT_GENERATION_ACTION_UNSPECIFIED: NextGenerationAction
NEXT_GENERATION_ACTION_WAIT: NextGenerationAction
NEXT_GENERATION_ACTION_START: NextGenerationAction
NEXT_GENERATION_ACTION_EXIT: NextGenerationAction
FAULT_KIND_UNSPECIFIED: FaultKind
FAULT_KIND_CRASH: FaultKind
FAULT_KIND_KILL: FaultKind
FAULT_KIND_HANG: FaultKind
FAULT_KIND_SLOW: FaultKind
FAULT_KIND_LOSE_NODE: FaultKind
FAULT_KIND_KILL_LEADER: FaultKind
FAULT_KIND_RESTART_ETCD: FaultKind
FAULT_KIND_KILL_AGENT: FaultKind
FAULT_KIND_TERM_AGENT: FaultKind
FAULT_KIND_TERM_LEADER: FaultKind
FAULT_KIND_STALL_LEADER: FaultKind
FAULT_KIND_STALL_AGENT: FaultKind
FAULT_KIND_STALL_NODE: FaultKind
FAULT_KIND_PARTITION_NODE: FaultKind

class CertificateRequest(_message.Message):
    __slots__ = ("node", "csr_pem")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    node: str
    csr_pem: bytes
    def __init__(self, node: _Optional[str] = ..., csr_pem: _Optional[bytes] = ...) -> None: ...

class CertificateReply(_message.Message):
    __slots__ = ("certificate_pem", "pending", "message")
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: bytes
    pending: bool
    message: str
    def __init__(self, certificate_pem: _Optional[bytes] = ..., pending: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class CertificateStatus(_message.Message):
    __slots__ = ("node", "state", "key_sha256", "serial", "not_after_unix", "changed_at_unix", "by", "message", "issued")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KEY_SHA256_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_UNIX_FIELD_NUMBER: _ClassVar[int]
    CHANGED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ISSUED_FIELD_NUMBER: _ClassVar[int]
    node: str
    state: str
    key_sha256: str
    serial: str
    not_after_unix: float
    changed_at_unix: float
    by: str
    message: str
    issued: int
    def __init__(self, node: _Optional[str] = ..., state: _Optional[str] = ..., key_sha256: _Optional[str] = ..., serial: _Optional[str] = ..., not_after_unix: _Optional[float] = ..., changed_at_unix: _Optional[float] = ..., by: _Optional[str] = ..., message: _Optional[str] = ..., issued: _Optional[int] = ...) -> None: ...

class ListCertificatesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListCertificatesReply(_message.Message):
    __slots__ = ("certificates",)
    CERTIFICATES_FIELD_NUMBER: _ClassVar[int]
    certificates: _containers.RepeatedCompositeFieldContainer[CertificateStatus]
    def __init__(self, certificates: _Optional[_Iterable[_Union[CertificateStatus, _Mapping]]] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("hello", "rendezvous_ready", "rank_exited", "steps", "checkpoint_saved", "generation_stopped", "hang_detected", "preflight", "status", "checkpoint_problem", "leaving", "log_chunk", "memory_snapshot_saved")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_READY_FIELD_NUMBER: _ClassVar[int]
    RANK_EXITED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SAVED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_STOPPED_FIELD_NUMBER: _ClassVar[int]
    HANG_DETECTED_FIELD_NUMBER: _ClassVar[int]
    PREFLIGHT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    LOG_CHUNK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SNAPSHOT_SAVED_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    rendezvous_ready: RendezvousReady
    rank_exited: RankExited
    steps: StepReportBatch
    checkpoint_saved: CheckpointSaved
    generation_stopped: GenerationStopped
    hang_detected: HangDetected
    preflight: PreflightReport
    status: AgentStatus
    checkpoint_problem: CheckpointProblem
    leaving: Leaving
    log_chunk: LogChunk
    memory_snapshot_saved: MemorySnapshotSaved
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., rendezvous_ready: _Optional[_Union[RendezvousReady, _Mapping]] = ..., rank_exited: _Optional[_Union[RankExited, _Mapping]] = ..., steps: _Optional[_Union[StepReportBatch, _Mapping]] = ..., checkpoint_saved: _Optional[_Union[CheckpointSaved, _Mapping]] = ..., generation_stopped: _Optional[_Union[GenerationStopped, _Mapping]] = ..., hang_detected: _Optional[_Union[HangDetected, _Mapping]] = ..., preflight: _Optional[_Union[PreflightReport, _Mapping]] = ..., status: _Optional[_Union[AgentStatus, _Mapping]] = ..., checkpoint_problem: _Optional[_Union[CheckpointProblem, _Mapping]] = ..., leaving: _Optional[_Union[Leaving, _Mapping]] = ..., log_chunk: _Optional[_Union[LogChunk, _Mapping]] = ..., memory_snapshot_saved: _Optional[_Union[MemorySnapshotSaved, _Mapping]] = ...) -> None: ...

class Leaving(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AgentStatus(_message.Message):
    __slots__ = ("job", "generation", "phase", "running", "started_job", "started_generation", "stuck")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    STARTED_JOB_FIELD_NUMBER: _ClassVar[int]
    STARTED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    STUCK_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    phase: AgentPhase
    running: _containers.RepeatedCompositeFieldContainer[RankAssignment]
    started_job: str
    started_generation: int
    stuck: _containers.RepeatedCompositeFieldContainer[StuckProcess]
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., phase: _Optional[_Union[AgentPhase, str]] = ..., running: _Optional[_Iterable[_Union[RankAssignment, _Mapping]]] = ..., started_job: _Optional[str] = ..., started_generation: _Optional[int] = ..., stuck: _Optional[_Iterable[_Union[StuckProcess, _Mapping]]] = ...) -> None: ...

class StuckProcess(_message.Message):
    __slots__ = ("pid", "rank", "state", "wchan")
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WCHAN_FIELD_NUMBER: _ClassVar[int]
    pid: int
    rank: int
    state: str
    wchan: str
    def __init__(self, pid: _Optional[int] = ..., rank: _Optional[int] = ..., state: _Optional[str] = ..., wchan: _Optional[str] = ...) -> None: ...

class CheckpointProblem(_message.Message):
    __slots__ = ("job", "generation", "step", "path", "kind", "reason", "suspect_node")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_NODE_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    step: int
    path: str
    kind: CheckpointProblemKind
    reason: str
    suspect_node: str
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., kind: _Optional[_Union[CheckpointProblemKind, str]] = ..., reason: _Optional[str] = ..., suspect_node: _Optional[str] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("welcome", "prepare_rendezvous", "start_generation", "stop_generation", "checkpoint_now", "checkpoint_recorded", "etcd_unreachable", "resync", "read_log", "report_pace", "release_replicas", "replica_partner", "term", "epoch")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    PREPARE_RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    START_GENERATION_FIELD_NUMBER: _ClassVar[int]
    STOP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_NOW_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_RECORDED_FIELD_NUMBER: _ClassVar[int]
    ETCD_UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    READ_LOG_FIELD_NUMBER: _ClassVar[int]
    REPORT_PACE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_PARTNER_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    prepare_rendezvous: PrepareRendezvous
    start_generation: StartGeneration
    stop_generation: StopGeneration
    checkpoint_now: CheckpointNow
    checkpoint_recorded: CheckpointRecorded
    etcd_unreachable: EtcdUnreachable
    resync: Resync
    read_log: ReadLog
    report_pace: ReportPace
    release_replicas: ReleaseReplicas
    replica_partner: ReplicaPartner
    term: int
    epoch: int
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., prepare_rendezvous: _Optional[_Union[PrepareRendezvous, _Mapping]] = ..., start_generation: _Optional[_Union[StartGeneration, _Mapping]] = ..., stop_generation: _Optional[_Union[StopGeneration, _Mapping]] = ..., checkpoint_now: _Optional[_Union[CheckpointNow, _Mapping]] = ..., checkpoint_recorded: _Optional[_Union[CheckpointRecorded, _Mapping]] = ..., etcd_unreachable: _Optional[_Union[EtcdUnreachable, _Mapping]] = ..., resync: _Optional[_Union[Resync, _Mapping]] = ..., read_log: _Optional[_Union[ReadLog, _Mapping]] = ..., report_pace: _Optional[_Union[ReportPace, _Mapping]] = ..., release_replicas: _Optional[_Union[ReleaseReplicas, _Mapping]] = ..., replica_partner: _Optional[_Union[ReplicaPartner, _Mapping]] = ..., term: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class Resync(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EtcdUnreachable(_message.Message):
    __slots__ = ("down_s", "hold_s")
    DOWN_S_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    down_s: float
    hold_s: float
    def __init__(self, down_s: _Optional[float] = ..., hold_s: _Optional[float] = ...) -> None: ...

class CheckpointRecorded(_message.Message):
    __slots__ = ("job", "generation", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    step: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class CheckpointNow(_message.Message):
    __slots__ = ("job", "generation", "reason", "after_step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    reason: str
    after_step: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., reason: _Optional[str] = ..., after_step: _Optional[int] = ...) -> None: ...

class HangDetected(_message.Message):
    __slots__ = ("job", "generation", "rank", "pid", "last_step", "stalled_for_s", "timeout_s", "phase", "stacks", "detected_at")
    class StacksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    STALLED_FOR_S_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AT_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    pid: int
    last_step: int
    stalled_for_s: float
    timeout_s: float
    phase: HangPhase
    stacks: _containers.ScalarMap[int, str]
    detected_at: float
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., last_step: _Optional[int] = ..., stalled_for_s: _Optional[float] = ..., timeout_s: _Optional[float] = ..., phase: _Optional[_Union[HangPhase, str]] = ..., stacks: _Optional[_Mapping[int, str]] = ..., detected_at: _Optional[float] = ...) -> None: ...

class CollectiveResult(_message.Message):
    __slots__ = ("collective", "size_bytes", "time_s", "algbw_gbps", "busbw_gbps")
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    ALGBW_GBPS_FIELD_NUMBER: _ClassVar[int]
    BUSBW_GBPS_FIELD_NUMBER: _ClassVar[int]
    collective: Collective
    size_bytes: int
    time_s: float
    algbw_gbps: float
    busbw_gbps: float
    def __init__(self, collective: _Optional[_Union[Collective, str]] = ..., size_bytes: _Optional[int] = ..., time_s: _Optional[float] = ..., algbw_gbps: _Optional[float] = ..., busbw_gbps: _Optional[float] = ...) -> None: ...

class PreflightReport(_message.Message):
    __slots__ = ("job", "generation", "rank", "world_size", "results", "wall_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    world_size: int
    results: _containers.RepeatedCompositeFieldContainer[CollectiveResult]
    wall_s: float
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., results: _Optional[_Iterable[_Union[CollectiveResult, _Mapping]]] = ..., wall_s: _Optional[float] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node", "host", "slots", "lease_id", "pid", "running_job", "running_generation", "running", "heartbeat_s", "reconnect_max_s", "lease_ttl_s", "accelerator", "peer_address", "failure_domain", "replica_node")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_JOB_FIELD_NUMBER: _ClassVar[int]
    RUNNING_GENERATION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    RECONNECT_MAX_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    REPLICA_NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    host: str
    slots: int
    lease_id: int
    pid: int
    running_job: str
    running_generation: int
    running: _containers.RepeatedCompositeFieldContainer[RankAssignment]
    heartbeat_s: float
    reconnect_max_s: float
    lease_ttl_s: float
    accelerator: str
    peer_address: str
    failure_domain: str
    replica_node: str
    def __init__(self, node: _Optional[str] = ..., host: _Optional[str] = ..., slots: _Optional[int] = ..., lease_id: _Optional[int] = ..., pid: _Optional[int] = ..., running_job: _Optional[str] = ..., running_generation: _Optional[int] = ..., running: _Optional[_Iterable[_Union[RankAssignment, _Mapping]]] = ..., heartbeat_s: _Optional[float] = ..., reconnect_max_s: _Optional[float] = ..., lease_ttl_s: _Optional[float] = ..., accelerator: _Optional[str] = ..., peer_address: _Optional[str] = ..., failure_domain: _Optional[str] = ..., replica_node: _Optional[str] = ...) -> None: ...

class ReadLog(_message.Message):
    __slots__ = ("request_id", "job", "generation", "rank", "out_offset", "err_offset", "max_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ERR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    job: str
    generation: int
    rank: int
    out_offset: int
    err_offset: int
    max_bytes: int
    def __init__(self, request_id: _Optional[int] = ..., job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., out_offset: _Optional[int] = ..., err_offset: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("request_id", "out", "err", "out_offset", "err_offset", "running", "path", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    ERR_FIELD_NUMBER: _ClassVar[int]
    OUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ERR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    out: bytes
    err: bytes
    out_offset: int
    err_offset: int
    running: bool
    path: str
    error: str
    def __init__(self, request_id: _Optional[int] = ..., out: _Optional[bytes] = ..., err: _Optional[bytes] = ..., out_offset: _Optional[int] = ..., err_offset: _Optional[int] = ..., running: _Optional[bool] = ..., path: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("controller_id", "report_interval_s")
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    controller_id: str
    report_interval_s: float
    def __init__(self, controller_id: _Optional[str] = ..., report_interval_s: _Optional[float] = ...) -> None: ...

class ReportPace(_message.Message):
    __slots__ = ("interval_s",)
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    def __init__(self, interval_s: _Optional[float] = ...) -> None: ...

class ReleaseReplicas(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ReplicaPartner(_message.Message):
    __slots__ = ("job", "generation", "node", "address")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    node: str
    address: str
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., node: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class PrepareRendezvous(_message.Message):
    __slots__ = ("job", "generation")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class RendezvousReady(_message.Message):
    __slots__ = ("job", "generation", "host", "port")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    host: str
    port: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class RankAssignment(_message.Message):
    __slots__ = ("rank", "local_rank")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ...) -> None: ...

class StartGeneration(_message.Message):
    __slots__ = ("job", "generation", "world_size", "local_world_size", "master_addr", "master_port", "ranks", "command", "env", "restart_count", "checkpoint_dir", "restore_from", "mesh", "health", "deadlines", "restore_fallbacks", "group_rank", "group_world_size", "max_restarts", "working_dir", "cold_start", "job_id", "resume_from", "replica_node", "replica_address", "memory_copy")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FROM_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    DEADLINES_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    COLD_START_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    REPLICA_NODE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_COPY_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankAssignment]
    command: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    restart_count: int
    checkpoint_dir: str
    restore_from: str
    mesh: str
    health: HealthSpec
    deadlines: Deadlines
    restore_fallbacks: _containers.RepeatedScalarFieldContainer[str]
    group_rank: int
    group_world_size: int
    max_restarts: int
    working_dir: str
    cold_start: bool
    job_id: str
    resume_from: str
    replica_node: str
    replica_address: str
    memory_copy: MemoryCopy
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., local_world_size: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankAssignment, _Mapping]]] = ..., command: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., restart_count: _Optional[int] = ..., checkpoint_dir: _Optional[str] = ..., restore_from: _Optional[str] = ..., mesh: _Optional[str] = ..., health: _Optional[_Union[HealthSpec, _Mapping]] = ..., deadlines: _Optional[_Union[Deadlines, _Mapping]] = ..., restore_fallbacks: _Optional[_Iterable[str]] = ..., group_rank: _Optional[int] = ..., group_world_size: _Optional[int] = ..., max_restarts: _Optional[int] = ..., working_dir: _Optional[str] = ..., cold_start: _Optional[bool] = ..., job_id: _Optional[str] = ..., resume_from: _Optional[str] = ..., replica_node: _Optional[str] = ..., replica_address: _Optional[str] = ..., memory_copy: _Optional[_Union[MemoryCopy, _Mapping]] = ...) -> None: ...

class MemoryCopy(_message.Message):
    __slots__ = ("node", "step", "holder", "address")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node: str
    step: int
    holder: str
    address: str
    def __init__(self, node: _Optional[str] = ..., step: _Optional[int] = ..., holder: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class Deadlines(_message.Message):
    __slots__ = ("heartbeat_s", "hang_floor_s", "first_step_timeout_s", "checkpoint_timeout_s", "stop_grace_s", "collective_timeout_s", "startup_timeout_s", "lease_ttl_s", "node_lost_grace_s", "leader_ttl_s", "reconnect_max_s", "stop_deadline_s")
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    HANG_FLOOR_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STOP_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STARTUP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    NODE_LOST_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    LEADER_TTL_S_FIELD_NUMBER: _ClassVar[int]
    RECONNECT_MAX_S_FIELD_NUMBER: _ClassVar[int]
    STOP_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_s: float
    hang_floor_s: float
    first_step_timeout_s: float
    checkpoint_timeout_s: float
    stop_grace_s: float
    collective_timeout_s: float
    startup_timeout_s: float
    lease_ttl_s: float
    node_lost_grace_s: float
    leader_ttl_s: float
    reconnect_max_s: float
    stop_deadline_s: float
    def __init__(self, heartbeat_s: _Optional[float] = ..., hang_floor_s: _Optional[float] = ..., first_step_timeout_s: _Optional[float] = ..., checkpoint_timeout_s: _Optional[float] = ..., stop_grace_s: _Optional[float] = ..., collective_timeout_s: _Optional[float] = ..., startup_timeout_s: _Optional[float] = ..., lease_ttl_s: _Optional[float] = ..., node_lost_grace_s: _Optional[float] = ..., leader_ttl_s: _Optional[float] = ..., reconnect_max_s: _Optional[float] = ..., stop_deadline_s: _Optional[float] = ...) -> None: ...

class StopGeneration(_message.Message):
    __slots__ = ("job", "generation", "reason", "collect_stacks")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COLLECT_STACKS_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    reason: str
    collect_stacks: bool
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., reason: _Optional[str] = ..., collect_stacks: _Optional[bool] = ...) -> None: ...

class RankExited(_message.Message):
    __slots__ = ("job", "generation", "rank", "pid", "exit_code", "signal", "traceback", "stderr_tail", "exited_at", "stopped_by_agent", "last_step", "reaped_at", "parked")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_FIELD_NUMBER: _ClassVar[int]
    EXITED_AT_FIELD_NUMBER: _ClassVar[int]
    STOPPED_BY_AGENT_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    REAPED_AT_FIELD_NUMBER: _ClassVar[int]
    PARKED_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    pid: int
    exit_code: int
    signal: int
    traceback: str
    stderr_tail: str
    exited_at: float
    stopped_by_agent: bool
    last_step: int
    reaped_at: float
    parked: bool
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., traceback: _Optional[str] = ..., stderr_tail: _Optional[str] = ..., exited_at: _Optional[float] = ..., stopped_by_agent: _Optional[bool] = ..., last_step: _Optional[int] = ..., reaped_at: _Optional[float] = ..., parked: _Optional[bool] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("rank", "step", "loss", "tokens", "step_time_s", "at", "data_s", "compute_s", "optimizer_s", "checkpoint_s", "checkpointing", "restore_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    DATA_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    loss: float
    tokens: int
    step_time_s: float
    at: float
    data_s: float
    compute_s: float
    optimizer_s: float
    checkpoint_s: float
    checkpointing: bool
    restore_s: float
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., step_time_s: _Optional[float] = ..., at: _Optional[float] = ..., data_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., optimizer_s: _Optional[float] = ..., checkpoint_s: _Optional[float] = ..., checkpointing: _Optional[bool] = ..., restore_s: _Optional[float] = ...) -> None: ...

class StepReportBatch(_message.Message):
    __slots__ = ("job", "generation", "node_steps", "replayed")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    node_steps: _containers.RepeatedCompositeFieldContainer[NodeStep]
    replayed: bool
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., node_steps: _Optional[_Iterable[_Union[NodeStep, _Mapping]]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class NodeStep(_message.Message):
    __slots__ = ("step", "ranks", "step_time_s", "tokens", "at", "checkpoint_s", "restore_s", "loss")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_S_FIELD_NUMBER: _ClassVar[int]
    RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    step: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    step_time_s: _containers.RepeatedScalarFieldContainer[float]
    tokens: int
    at: float
    checkpoint_s: float
    restore_s: float
    loss: float
    def __init__(self, step: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., step_time_s: _Optional[_Iterable[float]] = ..., tokens: _Optional[int] = ..., at: _Optional[float] = ..., checkpoint_s: _Optional[float] = ..., restore_s: _Optional[float] = ..., loss: _Optional[float] = ...) -> None: ...

class CheckpointSaved(_message.Message):
    __slots__ = ("job", "generation", "step", "path", "samples", "save_s", "bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAVE_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    step: int
    path: str
    samples: int
    save_s: float
    bytes: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., samples: _Optional[int] = ..., save_s: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...

class MemorySnapshotSaved(_message.Message):
    __slots__ = ("job", "generation", "step", "samples", "bytes", "save_s", "replicated_to", "replicate_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SAVE_S_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_TO_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    step: int
    samples: int
    bytes: int
    save_s: float
    replicated_to: str
    replicate_s: float
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., samples: _Optional[int] = ..., bytes: _Optional[int] = ..., save_s: _Optional[float] = ..., replicated_to: _Optional[str] = ..., replicate_s: _Optional[float] = ...) -> None: ...

class GenerationStopped(_message.Message):
    __slots__ = ("job", "generation")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("name", "world_size", "command", "env", "max_restarts", "steps", "checkpoint_dir", "mesh", "min_nodes", "model", "training", "health", "ranks_per_node", "working_dir", "cold_start", "resume_from", "on_no_checkpoint")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    RANKS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    COLD_START_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    ON_NO_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    world_size: int
    command: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    max_restarts: int
    steps: int
    checkpoint_dir: str
    mesh: str
    min_nodes: int
    model: ModelShape
    training: TrainingShape
    health: HealthSpec
    ranks_per_node: int
    working_dir: str
    cold_start: bool
    resume_from: str
    on_no_checkpoint: OnNoCheckpoint
    def __init__(self, name: _Optional[str] = ..., world_size: _Optional[int] = ..., command: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., max_restarts: _Optional[int] = ..., steps: _Optional[int] = ..., checkpoint_dir: _Optional[str] = ..., mesh: _Optional[str] = ..., min_nodes: _Optional[int] = ..., model: _Optional[_Union[ModelShape, _Mapping]] = ..., training: _Optional[_Union[TrainingShape, _Mapping]] = ..., health: _Optional[_Union[HealthSpec, _Mapping]] = ..., ranks_per_node: _Optional[int] = ..., working_dir: _Optional[str] = ..., cold_start: _Optional[bool] = ..., resume_from: _Optional[str] = ..., on_no_checkpoint: _Optional[_Union[OnNoCheckpoint, str]] = ...) -> None: ...

class HealthSpec(_message.Message):
    __slots__ = ("straggler_policy", "hang_floor_s", "hang_k", "first_step_timeout_s", "checkpoint_timeout_s", "straggler_slowdown", "straggler_window", "straggler_patience", "preflight_off", "max_replacements_per_hour", "stop_grace_s", "collective_timeout_s", "startup_timeout_s")
    STRAGGLER_POLICY_FIELD_NUMBER: _ClassVar[int]
    HANG_FLOOR_S_FIELD_NUMBER: _ClassVar[int]
    HANG_K_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_PATIENCE_FIELD_NUMBER: _ClassVar[int]
    PREFLIGHT_OFF_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLACEMENTS_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    STOP_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STARTUP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    straggler_policy: StragglerPolicy
    hang_floor_s: float
    hang_k: float
    first_step_timeout_s: float
    checkpoint_timeout_s: float
    straggler_slowdown: float
    straggler_window: int
    straggler_patience: int
    preflight_off: bool
    max_replacements_per_hour: int
    stop_grace_s: float
    collective_timeout_s: float
    startup_timeout_s: float
    def __init__(self, straggler_policy: _Optional[_Union[StragglerPolicy, str]] = ..., hang_floor_s: _Optional[float] = ..., hang_k: _Optional[float] = ..., first_step_timeout_s: _Optional[float] = ..., checkpoint_timeout_s: _Optional[float] = ..., straggler_slowdown: _Optional[float] = ..., straggler_window: _Optional[int] = ..., straggler_patience: _Optional[int] = ..., preflight_off: _Optional[bool] = ..., max_replacements_per_hour: _Optional[int] = ..., stop_grace_s: _Optional[float] = ..., collective_timeout_s: _Optional[float] = ..., startup_timeout_s: _Optional[float] = ...) -> None: ...

class ModelShape(_message.Message):
    __slots__ = ("params", "layers", "hidden", "heads", "vocab")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FIELD_NUMBER: _ClassVar[int]
    params: float
    layers: int
    hidden: int
    heads: int
    vocab: int
    def __init__(self, params: _Optional[float] = ..., layers: _Optional[int] = ..., hidden: _Optional[int] = ..., heads: _Optional[int] = ..., vocab: _Optional[int] = ...) -> None: ...

class TrainingShape(_message.Message):
    __slots__ = ("seq_len", "micro_batch", "global_batch", "microbatches", "precision", "gpu_memory_gb")
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_GB_FIELD_NUMBER: _ClassVar[int]
    seq_len: int
    micro_batch: int
    global_batch: int
    microbatches: int
    precision: Precision
    gpu_memory_gb: float
    def __init__(self, seq_len: _Optional[int] = ..., micro_batch: _Optional[int] = ..., global_batch: _Optional[int] = ..., microbatches: _Optional[int] = ..., precision: _Optional[_Union[Precision, str]] = ..., gpu_memory_gb: _Optional[float] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ...) -> None: ...

class SubmitJobReply(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class CommittedCheckpoint(_message.Message):
    __slots__ = ("step", "path", "generation", "samples")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    generation: int
    samples: int
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., generation: _Optional[int] = ..., samples: _Optional[int] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("generation", "node", "rank", "pid", "exit_code", "signal", "traceback", "stderr_tail", "exited_at", "last_step")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_FIELD_NUMBER: _ClassVar[int]
    EXITED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    generation: int
    node: str
    rank: int
    pid: int
    exit_code: int
    signal: int
    traceback: str
    stderr_tail: str
    exited_at: float
    last_step: int
    def __init__(self, generation: _Optional[int] = ..., node: _Optional[str] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., traceback: _Optional[str] = ..., stderr_tail: _Optional[str] = ..., exited_at: _Optional[float] = ..., last_step: _Optional[int] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job", "state", "reason", "generation", "world_size", "restarts", "step", "target_steps", "loss", "initial_loss", "tokens_per_s", "tokens", "last_checkpoint", "failures", "has_loss", "mesh", "events", "preflight", "step_time_s", "goodput", "submitted_at", "ended_at", "job_id", "last_memory_snapshot")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    INITIAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    PREFLIGHT_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_MEMORY_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    job: str
    state: JobState
    reason: str
    generation: int
    world_size: int
    restarts: int
    step: int
    target_steps: int
    loss: float
    initial_loss: float
    tokens_per_s: float
    tokens: int
    last_checkpoint: CommittedCheckpoint
    failures: _containers.RepeatedCompositeFieldContainer[Failure]
    has_loss: bool
    mesh: str
    events: _containers.RepeatedCompositeFieldContainer[Event]
    preflight: _containers.RepeatedCompositeFieldContainer[NodePreflight]
    step_time_s: float
    goodput: Goodput
    submitted_at: float
    ended_at: float
    job_id: str
    last_memory_snapshot: MemorySnapshot
    def __init__(self, job: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., restarts: _Optional[int] = ..., step: _Optional[int] = ..., target_steps: _Optional[int] = ..., loss: _Optional[float] = ..., initial_loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., tokens: _Optional[int] = ..., last_checkpoint: _Optional[_Union[CommittedCheckpoint, _Mapping]] = ..., failures: _Optional[_Iterable[_Union[Failure, _Mapping]]] = ..., has_loss: _Optional[bool] = ..., mesh: _Optional[str] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., preflight: _Optional[_Iterable[_Union[NodePreflight, _Mapping]]] = ..., step_time_s: _Optional[float] = ..., goodput: _Optional[_Union[Goodput, _Mapping]] = ..., submitted_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., job_id: _Optional[str] = ..., last_memory_snapshot: _Optional[_Union[MemorySnapshot, _Mapping]] = ...) -> None: ...

class MemorySnapshot(_message.Message):
    __slots__ = ("step", "generation", "samples", "bytes", "nodes", "recorded_at", "replica_step", "replica_node")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    RECORDED_AT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_NODE_FIELD_NUMBER: _ClassVar[int]
    step: int
    generation: int
    samples: int
    bytes: int
    nodes: _containers.RepeatedScalarFieldContainer[str]
    recorded_at: float
    replica_step: int
    replica_node: str
    def __init__(self, step: _Optional[int] = ..., generation: _Optional[int] = ..., samples: _Optional[int] = ..., bytes: _Optional[int] = ..., nodes: _Optional[_Iterable[str]] = ..., recorded_at: _Optional[float] = ..., replica_step: _Optional[int] = ..., replica_node: _Optional[str] = ...) -> None: ...

class Goodput(_message.Message):
    __slots__ = ("ratio", "accounted_s", "seconds", "at_risk_s")
    class SecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RATIO_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTED_S_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    AT_RISK_S_FIELD_NUMBER: _ClassVar[int]
    ratio: float
    accounted_s: float
    seconds: _containers.ScalarMap[str, float]
    at_risk_s: float
    def __init__(self, ratio: _Optional[float] = ..., accounted_s: _Optional[float] = ..., seconds: _Optional[_Mapping[str, float]] = ..., at_risk_s: _Optional[float] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("kind", "node", "rank", "step", "detected_after_s", "detected_after_steps", "root_cause", "stacks", "reason", "generation", "at", "seq")
    class StacksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AFTER_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROOT_CAUSE_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    node: str
    rank: int
    step: int
    detected_after_s: float
    detected_after_steps: int
    root_cause: str
    stacks: _containers.ScalarMap[int, str]
    reason: str
    generation: int
    at: float
    seq: int
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., node: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., detected_after_s: _Optional[float] = ..., detected_after_steps: _Optional[int] = ..., root_cause: _Optional[str] = ..., stacks: _Optional[_Mapping[int, str]] = ..., reason: _Optional[str] = ..., generation: _Optional[int] = ..., at: _Optional[float] = ..., seq: _Optional[int] = ...) -> None: ...

class NodePreflight(_message.Message):
    __slots__ = ("node", "generation", "results", "slow")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SLOW_FIELD_NUMBER: _ClassVar[int]
    node: str
    generation: int
    results: _containers.RepeatedCompositeFieldContainer[CollectiveResult]
    slow: bool
    def __init__(self, node: _Optional[str] = ..., generation: _Optional[int] = ..., results: _Optional[_Iterable[_Union[CollectiveResult, _Mapping]]] = ..., slow: _Optional[bool] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node", "host", "slots", "connected", "lease_id", "state", "cordon_reason", "job")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CORDON_REASON_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    node: str
    host: str
    slots: int
    connected: bool
    lease_id: int
    state: NodeState
    cordon_reason: str
    job: str
    def __init__(self, node: _Optional[str] = ..., host: _Optional[str] = ..., slots: _Optional[int] = ..., connected: _Optional[bool] = ..., lease_id: _Optional[int] = ..., state: _Optional[_Union[NodeState, str]] = ..., cordon_reason: _Optional[str] = ..., job: _Optional[str] = ...) -> None: ...

class NodeRequest(_message.Message):
    __slots__ = ("node", "reason")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node: str
    reason: str
    def __init__(self, node: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReplaceNodeRequest(_message.Message):
    __slots__ = ("node", "with_node")
    NODE_FIELD_NUMBER: _ClassVar[int]
    WITH_NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    with_node: str
    def __init__(self, node: _Optional[str] = ..., with_node: _Optional[str] = ...) -> None: ...

class NodeReply(_message.Message):
    __slots__ = ("node", "message")
    NODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    message: str
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class CheckpointJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class CheckpointJobReply(_message.Message):
    __slots__ = ("job", "generation", "after_step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    after_step: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., after_step: _Optional[int] = ...) -> None: ...

class StopJobRequest(_message.Message):
    __slots__ = ("job", "now", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    now: bool
    reason: str
    def __init__(self, job: _Optional[str] = ..., now: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class StopJobReply(_message.Message):
    __slots__ = ("job", "state", "message")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    job: str
    state: JobState
    message: str
    def __init__(self, job: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., message: _Optional[str] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class DeleteJobReply(_message.Message):
    __slots__ = ("job", "message")
    JOB_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    job: str
    message: str
    def __init__(self, job: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ReadLogRequest(_message.Message):
    __slots__ = ("job", "generation", "rank", "out_offset", "err_offset", "max_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ERR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    out_offset: int
    err_offset: int
    max_bytes: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., out_offset: _Optional[int] = ..., err_offset: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class ReadLogReply(_message.Message):
    __slots__ = ("job", "generation", "rank", "node", "out", "err", "out_offset", "err_offset", "running", "path")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    ERR_FIELD_NUMBER: _ClassVar[int]
    OUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ERR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    node: str
    out: bytes
    err: bytes
    out_offset: int
    err_offset: int
    running: bool
    path: str
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., node: _Optional[str] = ..., out: _Optional[bytes] = ..., err: _Optional[bytes] = ..., out_offset: _Optional[int] = ..., err_offset: _Optional[int] = ..., running: _Optional[bool] = ..., path: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...

class ListNodesReply(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("job_id", "node", "step", "file", "offset", "data", "files")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node: str
    step: int
    file: str
    offset: int
    data: bytes
    files: _containers.ScalarMap[str, int]
    def __init__(self, job_id: _Optional[str] = ..., node: _Optional[str] = ..., step: _Optional[int] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., files: _Optional[_Mapping[str, int]] = ...) -> None: ...

class SnapshotReceived(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class SnapshotWanted(_message.Message):
    __slots__ = ("job_id", "node", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node: str
    step: int
    def __init__(self, job_id: _Optional[str] = ..., node: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class RankAttach(_message.Message):
    __slots__ = ("generation", "rank", "restart_in_place")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESTART_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    restart_in_place: bool
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., restart_in_place: _Optional[bool] = ...) -> None: ...

class RankPark(_message.Message):
    __slots__ = ("generation", "rank", "failed", "reason", "tearing_down")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TEARING_DOWN_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    failed: bool
    reason: str
    tearing_down: bool
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., failed: _Optional[bool] = ..., reason: _Optional[str] = ..., tearing_down: _Optional[bool] = ...) -> None: ...

class NextGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NextGenerationAnswer(_message.Message):
    __slots__ = ("action", "env", "stdout", "stderr", "reason")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    action: NextGenerationAction
    env: _containers.ScalarMap[str, str]
    stdout: str
    stderr: str
    reason: str
    def __init__(self, action: _Optional[_Union[NextGenerationAction, str]] = ..., env: _Optional[_Mapping[str, str]] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LocalStepReports(_message.Message):
    __slots__ = ("generation", "reports")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    reports: _containers.RepeatedCompositeFieldContainer[StepReport]
    def __init__(self, generation: _Optional[int] = ..., reports: _Optional[_Iterable[_Union[StepReport, _Mapping]]] = ...) -> None: ...

class LocalAck(_message.Message):
    __slots__ = ("checkpoint_now", "recorded_step", "leave_generation", "checkpoint_after_step")
    CHECKPOINT_NOW_FIELD_NUMBER: _ClassVar[int]
    RECORDED_STEP_FIELD_NUMBER: _ClassVar[int]
    LEAVE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    checkpoint_now: bool
    recorded_step: int
    leave_generation: bool
    checkpoint_after_step: int
    def __init__(self, checkpoint_now: _Optional[bool] = ..., recorded_step: _Optional[int] = ..., leave_generation: _Optional[bool] = ..., checkpoint_after_step: _Optional[int] = ...) -> None: ...

class Fault(_message.Message):
    __slots__ = ("kind", "rank", "node", "step", "factor", "down_s", "for_s")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    DOWN_S_FIELD_NUMBER: _ClassVar[int]
    FOR_S_FIELD_NUMBER: _ClassVar[int]
    kind: FaultKind
    rank: int
    node: int
    step: int
    factor: float
    down_s: float
    for_s: float
    def __init__(self, kind: _Optional[_Union[FaultKind, str]] = ..., rank: _Optional[int] = ..., node: _Optional[int] = ..., step: _Optional[int] = ..., factor: _Optional[float] = ..., down_s: _Optional[float] = ..., for_s: _Optional[float] = ...) -> None: ...

class FaultSchedule(_message.Message):
    __slots__ = ("faults",)
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    faults: _containers.RepeatedCompositeFieldContainer[Fault]
    def __init__(self, faults: _Optional[_Iterable[_Union[Fault, _Mapping]]] = ...) -> None: ...
