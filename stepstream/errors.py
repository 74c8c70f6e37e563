"""Every error a stepstream user or operator can meet, importable from this one module.

Each class means one thing to act on and says whether the same call may simply be made
again (``retriable``, False unless noted). The classes live beside the code that raises
them; this module gathers them (``tests/unit/test_errors.py`` fails if one is missing)::

    StepstreamError                  base of everything below
    ├── from clients (start, send_event, cancel, request, result, ...)
    │   ├── UnknownWorkflow          no worker has that workflow (or version)
    │   ├── InvalidPayload           a bad id, name, or payload the codec cannot take
    │   ├── PayloadTooLarge          over STEPSTREAM_MAX_PAYLOAD_BYTES
    │   ├── UnknownInstance          no such instance (or forgotten after retention)
    │   ├── InstanceFinished         the command came after the instance finished
    │   ├── InstanceExists           start(if_exists="fail") of an id that exists
    │   ├── InstanceNotPaused        resume of an instance that is not paused
    │   ├── UnknownReplayKey         reset/fork to a key the history lacks (names the keys)
    │   ├── InstanceNotFailed        retry of an instance that has not failed
    │   ├── WorkflowFailed           result(): the workflow raised or a step failed for good
    │   │   └── WorkflowTimeout      the run passed its @workflow(timeout=)
    │   ├── WorkflowCancelled        result(): the instance was cancelled
    │   │   └── WorkflowTerminated   result(): the instance was terminated
    │   ├── ResultTimeout            result()/request() gave up waiting   (retriable)
    │   ├── ConnectionFailed         the engine or worker could not be reached (retriable)
    │   │   ├── SessionUnavailable   the server opened no session websocket (an older
    │   │   │                        server, or a proxy that drops upgrades)
    │   │   ├── NotListening         no connection could be made to the address (refused,
    │   │   │                        unknown name): nothing was sent
    │   │   └── ConnectionLost       the connection broke after the call was sent: a
    │   │                            command may have been applied (not retriable); a
    │   │                            wait or a read the http:// client asked again
    │   ├── AccessDenied             the API refused the token, Origin or Host
    │   └── ServerUnavailable        HTTP 503: the server cannot take the call now, its
    │       │                        fault, not the call's (a full disk); .retry_after
    │       │                        seconds (retriable)
    │       └── ServerBusy           the API holds --max-pending calls and waits over all
    │                                its clients (STEPSTREAM_MAX_PENDING)
    ├── in workflow code (raised at the ctx call; the workflow may catch them)
    │   ├── StepFailed               a step used up its attempts (.kind says how)
    │   ├── StepTimeout              one attempt ran past its timeout (inside the step)
    │   ├── EventTimeout             a wait or ctx.messages.next timed out
    │   ├── JoinError                branches of ctx.join raised (.errors, .results)
    │   ├── RaceError                every branch of ctx.race raised
    │   ├── RolledBack               an exception left a ctx.saga (.cause)
    │   ├── ChildFailed              a child workflow failed or was cancelled
    │   ├── InvalidWorkflowCall      a ctx call that cannot be replayed (fix the code)
    │   └── NondeterministicCall     the code used a real-time asyncio API (asyncio.sleep,
    │                                loop.time): use ctx.sleep, ctx.now
    ├── HistoryDiverged              the code no longer matches an instance's history
    │   │                            (the instance is parked; deploy matching code)
    │   ├── ReplayDiverged           stepstream.testing.replay found the same
    │   └── RecordedPayloadUnreadable  a recorded value this engine's codec cannot read
    │                                (a key it lacks: parked until an engine that has it)
    ├── DuplicateWorkflow            two definitions of one name and version
    ├── UndecodableRecord            bytes on a topic that are no record of this version
    ├── InvalidHistoryFile           a history export that cannot be read
    ├── InvalidTransition            a record asked for a status change the state machine
    │                                refuses (a defect: report it)
    └── starting and running an engine (operators)
        ├── ConfigError              a flag or STEPSTREAM_* variable is not usable
        ├── KafkaSettingsError       a Kafka setting is malformed or missing
        │   └── KafkaAuthenticationFailed  the cluster refused the SASL login or
        │                            the TLS handshake (the message names the setting)
        ├── InsecureBind             serving beyond loopback without a token (--insecure)
        ├── BrokerError              a local broker cannot start: Java, Maven or a jar is
        │                            missing (the message says what to install)
        ├── DataDirInUse             another process owns the embedded data directory
        ├── PartitionCountMismatch   the data directory has another partition count
        ├── StorageFailed            a durable write failed: reopen the directory
        │   ├── DiskFull             no space left: free some, then start again
        │   └── DataDirCorrupted     RocksDB found the directory damaged: restore it
        ├── StateDirInUse            another worker holds this Kafka state directory
        ├── StateWriteFailed         writing a partition's state failed (disk)
        ├── TopicsMissing            a topic stepstream needs does not exist
        ├── TopicsMismatch           topics with the wrong partition counts
        ├── GroupNotFound            topics lag: no consumer group of that name (no members,
        │                            no committed offsets)
        ├── ProduceFailed            a record could not be written to Kafka
        └── RestoreFailed            the history topic could not be read back

    NonRetryableError (an Exception, raised by step bodies: fail the step at once)
    └── OutboxNotConfigured          ctx.publish on an engine with no Kafka cluster
                                     (set STEPSTREAM_OUTBOX_BOOTSTRAP)

``Evicted`` is not here: it is internal control flow (a ``BaseException``) that workflow
code must never catch.
"""

from stepstream.consumers.embedded.errors import (
    DataDirCorrupted,
    DataDirInUse,
    DiskFull,
    PartitionCountMismatch,
    StorageFailed,
)
from stepstream.consumers.kafka.admin import TopicsMismatch, TopicsMissing
from stepstream.consumers.kafka.db import StateWriteFailed
from stepstream.consumers.kafka.group_lag import GroupNotFound
from stepstream.consumers.kafka.producer import ProduceFailed
from stepstream.consumers.kafka.restore import RestoreFailed
from stepstream.consumers.kafka.state_dir import StateDirInUse
from stepstream.engine.config.environ import ConfigError
from stepstream.engine.config.kafka import KafkaAuthenticationFailed, KafkaSettingsError
from stepstream.engine.errors import (
    AccessDenied,
    ChildFailed,
    ConnectionFailed,
    DuplicateWorkflow,
    EventTimeout,
    HistoryDiverged,
    InstanceExists,
    InstanceFinished,
    InstanceNotFailed,
    InstanceNotPaused,
    InvalidPayload,
    InvalidWorkflowCall,
    JoinError,
    NonRetryableError,
    OutboxNotConfigured,
    PayloadTooLarge,
    RaceError,
    RecordedPayloadUnreadable,
    ResultTimeout,
    RolledBack,
    StepFailed,
    StepstreamError,
    StepTimeout,
    UndecodableRecord,
    UnknownInstance,
    UnknownReplayKey,
    UnknownWorkflow,
    WorkflowCancelled,
    WorkflowFailed,
    WorkflowTerminated,
    WorkflowTimeout,
)
from stepstream.engine.replay.loop import NondeterministicCall
from stepstream.engine.replay.state import InvalidTransition
from stepstream.ops.api.security import InsecureBind
from stepstream.ops.brokers import BrokerError
from stepstream.ops.tools.history_export import InvalidHistoryFile
from stepstream.ops.tools.replay.results import ReplayDiverged
from stepstream.producers.http.session import NotListening, SessionUnavailable
from stepstream.producers.http.wire import ConnectionLost, ServerBusy, ServerUnavailable

__all__ = [
    "AccessDenied",
    "BrokerError",
    "ChildFailed",
    "ConfigError",
    "ConnectionFailed",
    "ConnectionLost",
    "DataDirCorrupted",
    "DataDirInUse",
    "DiskFull",
    "DuplicateWorkflow",
    "EventTimeout",
    "GroupNotFound",
    "HistoryDiverged",
    "InsecureBind",
    "InstanceExists",
    "InstanceFinished",
    "InstanceNotFailed",
    "InstanceNotPaused",
    "InvalidHistoryFile",
    "InvalidPayload",
    "InvalidTransition",
    "InvalidWorkflowCall",
    "JoinError",
    "KafkaAuthenticationFailed",
    "KafkaSettingsError",
    "NonRetryableError",
    "NondeterministicCall",
    "NotListening",
    "OutboxNotConfigured",
    "PartitionCountMismatch",
    "PayloadTooLarge",
    "ProduceFailed",
    "RaceError",
    "RecordedPayloadUnreadable",
    "ReplayDiverged",
    "RestoreFailed",
    "ResultTimeout",
    "RolledBack",
    "ServerBusy",
    "ServerUnavailable",
    "SessionUnavailable",
    "StateDirInUse",
    "StateWriteFailed",
    "StepFailed",
    "StepTimeout",
    "StepstreamError",
    "StorageFailed",
    "TopicsMismatch",
    "TopicsMissing",
    "UndecodableRecord",
    "UnknownInstance",
    "UnknownReplayKey",
    "UnknownWorkflow",
    "WorkflowCancelled",
    "WorkflowFailed",
    "WorkflowTerminated",
    "WorkflowTimeout",
]
