"""What the API server and the engine-core process say to each other, as msgspec types.

Plain data only (the engine's own dataclasses among it), encoded as MessagePack: no pickle, so
a message can be no more than the types below. Commands go to the core; one ``CoreOutputs``
comes back per engine step, holding every request's new output of that step.
"""

from __future__ import annotations

import msgspec

from pagedserve.engine.input_processor import InputLimits
from pagedserve.engine.stats import EngineStats
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None  # None: the base model
    # A pooling request's settings (``params`` is then unused): its output is an embedding.
    pooling: PoolingParams | None = None
    priority: int = 0  # --scheduling-policy priority: lower is served earlier

    @property
    def engine_params(self) -> SamplingParams | PoolingParams:
        """What ``LLMEngine.add_request`` and ``InputLimits.check`` take."""
        return self.params if self.pooling is None else self.pooling


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    """Requests the core admits in the same step (all prompts of one API request, say)."""

    requests: list[NewRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class RemoveLoRA(msgspec.Struct, tag=True, array_like=True):
    """Forget an adapter (its device slot, host copy and content hash on every rank); the
    server sends it once no request of the adapter is left in flight."""

    lora_int_id: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class ResetPrefixCache(msgspec.Struct, tag=True, array_like=True):
    call_id: int


class Sleep(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    level: int


class WakeUp(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    tags: list[str] | None  # None: everything asleep


# Sleep mode and the prefix-cache reset: calls the server awaits, each answered by one
# ``ControlDone`` of its ``call_id``, applied between steps in order with the other commands.
Control = ResetPrefixCache | Sleep | WakeUp
Command = AddRequests | AbortRequests | RemoveLoRA | Shutdown | Control


class LoRAFacts(msgspec.Struct, array_like=True):
    """What an adapter must fit to be served (``--max-lora-rank`` and the model's projection
    shapes), so that the API server can refuse one before any request of it reaches the core."""

    max_rank: int
    num_layers: int
    # (projection, shard, out_features, in_features) of every shard a LoRA layer adapts
    shapes: list[tuple[str, int, int, int]]

    def check(self, name: str, path: str) -> None:
        """Read the adapter at ``path`` as the engine will; ``ValueError`` (one line) if it
        cannot be served."""
        from pagedserve.lora.adapter import check_fits, load_adapter

        shapes = {(p, shard): (out, inp) for p, shard, out, inp in self.shapes}
        check_fits(name, load_adapter(path), self.max_rank, self.num_layers, shapes)


class EngineFacts(msgspec.Struct):
    """What the API server needs to know of the engine, sent once the core is up."""

    model_name: str
    limits: InputLimits
    lora: LoRAFacts | None = None  # None: LoRA is off
    # --generation-config's defaults for the sampling fields a request leaves unset.
    sampling_defaults: dict[str, float | int] = msgspec.field(default_factory=dict)
    labels: tuple[str, ...] = ()  # a sequence classifier's label names, in label order


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    facts: EngineFacts


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    """The core could not start (bad model, device, flag); the message is one line."""

    message: str


class SequenceDelta(msgspec.Struct, array_like=True):
    """What one sequence gained in a step (a "delta" ``CompletionOutput``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(msgspec.Struct, array_like=True):
    """A request's output of one step, without what the API server knows already (its
    prompt): the server adds it to the ``RequestOutput`` it keeps (``add_delta``)."""

    request_id: str
    outputs: list[SequenceDelta]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None
    metrics: RequestMetrics | None  # sent once, with the finished output
    # A pooling request's embedding (float32 values, sent as msgpack floats), once finished.
    embedding: list[float] | None = None

    @classmethod
    def of(cls, output: RequestOutput) -> RequestDelta:
        return cls(output.request_id, [
            SequenceDelta(o.index, o.text, o.token_ids, o.cumulative_logprob, o.logprobs,
                          o.finish_reason, o.stop_reason) for o in output.outputs],
            output.finished, output.prompt_logprobs,
            output.metrics if output.finished else None, output.embedding)


class RequestFailure(msgspec.Struct, array_like=True):
    request_id: str
    message: str
    param: str | None = None
    # "invalid" for input the engine refused, "step" for a step that failed under it,
    # "asleep" for a request that reached an engine in sleep mode.
    kind: str = "step"


class CoreOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[RequestDelta]
    failures: list[RequestFailure]
    stats: EngineStats


class ControlDone(msgspec.Struct, tag=True, array_like=True):
    """The answer to a ``Control`` command: its result (``reset_prefix_cache``'s bool; True
    for the others), whether the engine sleeps now, and why it failed (one line), if it did."""

    call_id: int
    result: bool
    sleeping: bool
    error: str | None = None


CoreMessage = CoreReady | CoreFailed | CoreOutputs | ControlDone

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
decode_command = msgspec.msgpack.Decoder(Command).decode
decode_core_message = msgspec.msgpack.Decoder(CoreMessage).decode
