"""Fields appended with defaults cross versions both ways without a version bump: an older
peer's message decodes with the default, and a newer one decodes on an older peer, the new
field ignored (Heartbeat.stats, SchedulerInfo.worker_plan)."""

from __future__ import annotations

import msgspec

from protocol.messages import (
    PROTOCOL_VERSION,
    EngineStats,
    Heartbeat,
    SchedulerInfo,
    SchedulerToFrontend,
)


class OldHeartbeat(msgspec.Struct, tag="Heartbeat", array_like=True, frozen=True, kw_only=True):
    sender: str
    time: float


class OldSchedulerInfo(
    msgspec.Struct, tag="SchedulerInfo", array_like=True, frozen=True, kw_only=True
):
    protocol_version: int
    worker_ready: bool
    model_id: str = ""
    max_model_len: int = 0
    num_blocks: int = 0
    block_size: int = 0
    reason: str = ""


def test_an_older_peers_messages_decode_with_the_defaults() -> None:
    decode = msgspec.msgpack.Decoder(SchedulerToFrontend).decode
    beat = decode(msgspec.msgpack.encode(OldHeartbeat(sender="s", time=1.0)))
    assert beat == Heartbeat(sender="s", time=1.0) and beat.stats is None
    info = decode(msgspec.msgpack.encode(OldSchedulerInfo(protocol_version=1, worker_ready=True)))
    assert isinstance(info, SchedulerInfo) and info.worker_plan == {}


def test_an_older_peer_decodes_the_newer_messages() -> None:
    old = msgspec.msgpack.Decoder(OldHeartbeat | OldSchedulerInfo).decode
    beat = Heartbeat(sender="s", time=1.0, stats=EngineStats(num_running=3))
    assert old(msgspec.msgpack.encode(beat)) == OldHeartbeat(sender="s", time=1.0)
    info = SchedulerInfo(
        protocol_version=PROTOCOL_VERSION, worker_ready=True, worker_plan={"device": "cpu"}
    )
    assert old(msgspec.msgpack.encode(info)) == OldSchedulerInfo(
        protocol_version=PROTOCOL_VERSION, worker_ready=True
    )
