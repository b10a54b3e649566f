"""Everything that crosses the front end ↔ engine-core process boundary: msgspec structs (msgpack).

Sockets (see core_proc.py): the front end binds a ROUTER for input and a PULL for output; the core
connects a DEALER and a PUSH. Input messages are two frames, `[RequestType, payload]`; output
messages are one frame: an encoded `EngineCoreOutputs`, or the raw `ENGINE_CORE_DEAD` sentinel.

Handshake, on the input pair (so the ROUTER knows the core's identity before it sends anything):
    core → HandshakeHello(pid, rank)
    front end → HandshakeInit(output address, engine config)
    core → HandshakeReady(num_blocks, ...)  or  HandshakeFailed(message)

Data parallel: N cores (ranks) share the front end's two sockets; each core's DEALER identity is
its rank (`rank_identity`), and every output message names its rank and carries its load
(`RankCounts`). Ranks in wave mode also talk to the wave coordinator (WaveSync, dp_coordinator.py).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Union

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.sampling_params import SamplingParams

# Sent raw (not msgpack) on the output socket by a core that is about to die of a fatal error.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


class RequestType(bytes, enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    START_WAVE = b"\x03"  # payload: the wave number; ranks in wave mode start stepping it


def rank_identity(rank: int) -> bytes:
    """The ZMQ identity of data-parallel rank `rank`'s input socket."""
    return rank.to_bytes(2, "little")


# ---- requests in ---------------------------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams' init fields (see params_to_dict)
    arrival_time: float = 0.0


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str  # a name in EngineCoreProc.utility_methods
    args: tuple = ()


# ---- outputs out ---------------------------------------------------------------------------------


class LogprobsMsg(msgspec.Struct, array_like=True):
    """One position's logprobs (same fields as core.step_io.Logprobs)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's update from one step (the fields of core.scheduler.RequestUpdate)."""

    req_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None
    logprobs: list[LogprobsMsg] | None = None  # one per new token
    prompt_logprobs: list[LogprobsMsg] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # the core refused the request (it is finished)


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    failure_message: str | None = None


class RankCounts(msgspec.Struct, array_like=True):
    """A rank's load as the front end balances it: its scheduler's queues, and how many requests it
    has received in all (the front end compares it with how many it sent: the rest are in transit)."""

    num_waiting: int
    num_running: int
    num_received: int


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    utility_output: UtilityResult | None = None
    engine_index: int = 0  # the data-parallel rank that sent it
    counts: RankCounts | None = None
    wave_complete: int | None = None  # wave mode: the ranks agreed that this wave is over; idle now
    start_wave: int | None = None  # wave mode: an idle rank got a request; every rank must step this wave


# ---- the wave collective (dp_coordinator.py) ------------------------------------------------------


class WaveSync(msgspec.Struct, array_like=True):
    """A rank's vote at one sync point of a wave: does it still have requests?"""

    wave: int
    sync_point: int  # the how-manieth sync of this wave (every WAVE_SYNC_STEPS steps)
    has_work: bool


class WaveSyncResult(msgspec.Struct, array_like=True):
    """The OR of every rank's vote at that sync point: False ends the wave on every rank."""

    wave: int
    sync_point: int
    any_work: bool


# ---- handshake -----------------------------------------------------------------------------------


class HandshakeHello(msgspec.Struct, tag=True):
    pid: int
    rank: int = 0


class HandshakeInit(msgspec.Struct, tag=True):
    output_address: str
    engine_config: EngineConfig
    enable_prefix_caching: bool = True


class HandshakeReady(msgspec.Struct, tag=True):
    num_blocks: int
    block_size: int
    max_model_len: int


class HandshakeFailed(msgspec.Struct, tag=True):
    message: str


HandshakeMessage = Union[HandshakeHello, HandshakeInit, HandshakeReady, HandshakeFailed]


# ---- conversions ---------------------------------------------------------------------------------

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """The init fields that differ from the defaults (the core rebuilds and revalidates them)."""
    default = _DEFAULT_PARAMS
    return {
        name: getattr(params, name)
        for name in _PARAM_FIELDS
        if getattr(params, name) != getattr(default, name)
    }


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**d)


_DEFAULT_PARAMS = SamplingParams()


def output_from_update(u) -> EngineCoreOutput:
    """core.scheduler.RequestUpdate → EngineCoreOutput."""
    return EngineCoreOutput(
        req_id=u.req_id,
        new_token_ids=list(u.new_token_ids),
        finished=u.finished,
        finish_reason=u.finish_reason,
        stop_reason=u.stop_reason,
        logprobs=None if u.logprobs is None else [
            LogprobsMsg(list(p.token_ids), list(p.logprobs), int(p.rank)) for p in u.logprobs
        ],
        prompt_logprobs=None if not u.prompt_logprobs else [
            LogprobsMsg(list(p.token_ids), list(p.logprobs), int(p.rank)) for p in u.prompt_logprobs
        ],
        num_cached_tokens=u.num_cached_tokens,
    )


def _enc_hook(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def decoder(kind) -> msgspec.msgpack.Decoder:
    """A typed decoder: `decoder(EngineCoreOutputs)`, `decoder(HandshakeMessage)`, `decoder(list[str])`."""
    return msgspec.msgpack.Decoder(kind)
