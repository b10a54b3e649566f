"""Everything that crosses the front end ↔ engine-core process boundary: msgspec structs (msgpack).

Sockets (see core_proc.py): the front end binds a ROUTER for input and a PULL for output; the core
connects a DEALER and a PUSH. Input messages are two frames, `[RequestType, payload]`; output
messages are one frame: an encoded `EngineCoreOutputs`, or the raw `ENGINE_CORE_DEAD` sentinel.

Handshake, on the input pair (so the ROUTER knows the core's identity before it sends anything):
    core → HandshakeHello(pid)
    front end → HandshakeInit(output address, engine config)
    core → HandshakeReady(num_blocks, ...)  or  HandshakeFailed(message)
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


# ---- requests in ---------------------------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams' init fields (see params_to_dict)
    arrival_time: float = 0.0


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str  # a name in core_proc.UTILITY_METHODS
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
    logprobs: LogprobsMsg | None = None
    prompt_logprobs: list[LogprobsMsg] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # the core refused the request (it is finished)


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    failure_message: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    utility_output: UtilityResult | None = None


# ---- handshake -----------------------------------------------------------------------------------


class HandshakeHello(msgspec.Struct, tag=True):
    pid: int


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
    lp = u.logprobs
    return EngineCoreOutput(
        req_id=u.req_id,
        new_token_ids=list(u.new_token_ids),
        finished=u.finished,
        finish_reason=u.finish_reason,
        stop_reason=u.stop_reason,
        logprobs=None if lp is None else LogprobsMsg(list(lp.token_ids), list(lp.logprobs), int(lp.rank)),
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
