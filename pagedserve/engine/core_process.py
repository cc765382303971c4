"""The engine-core process: it builds the ``LLMEngine`` and does nothing but step it.

The API server process (``core_client``) owns HTTP, tokenizing and streaming; the two share no
interpreter and no GIL. The core pulls commands from one ZeroMQ socket and pushes one
``CoreOutputs`` per engine step to another: every request's new tokens and text of that step
(detokenizing stays here, where it overlaps the device's work under async scheduling),
failures, and a stats snapshot for /metrics.

Loop rules, as the in-process engine thread had them:
  * commands queued while a step ran are all applied before the next step, so requests sent
    together are admitted together;
  * a request the engine refuses fails alone (``RequestFailure`` kind "invalid");
  * an exception inside ``step`` aborts every request in flight, each gets a failure, and the
    loop goes on serving new ones;
  * the process exits on ``Shutdown``, or when its parent is gone (checked while idle), so a
    killed server never leaves a process holding the device;
  * when a tensor-parallel rank dies, the step in flight fails (its requests get failures)
    and the process exits with code 1 (checked after every step and while idle), so the
    server turns unhealthy instead of queueing requests no step will run.
"""

from __future__ import annotations

import gc
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection

from pagedserve.config import EngineConfig
from pagedserve.engine import core_messages as msg
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import EngineSleepingError
from pagedserve.logger import get_logger

logger = get_logger(__name__)

# How long an idle core waits for a command before it checks that its parent still runs.
_IDLE_POLL_MS = 500


@dataclass(frozen=True)
class CoreAddresses:
    commands: str  # the core pulls commands here
    outputs: str  # and pushes its outputs here


def run_engine_core(config: EngineConfig, addresses: CoreAddresses, ready: Connection) -> None:
    """Entry point of the core process: start the engine, report on ``ready`` that it is up
    (or why not, in one line), then loop."""
    import zmq

    # Ctrl-C in a terminal reaches the whole process group. The API server stops the core
    # (a Shutdown command, or its own exit, which the loop notices); a core killed by the
    # same signal midway could no longer be told, and the server's shutdown waited on it.
    # The processes it starts (tensor-parallel ranks, grammar compilers) inherit this.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    try:
        engine = LLMEngine(config)
    except Exception as exc:
        logger.debug("engine core failed to start", exc_info=True)
        ready.send_bytes(msg.encode(msg.CoreFailed(str(exc) or type(exc).__name__)))
        return
    # What start-up built (modules, model code, tokenizer) lives as long as the process: kept
    # out of the collector's sight, a full collection no longer walks it mid-step.
    gc.collect()
    gc.freeze()
    facts = msg.EngineFacts(engine.model_name, engine.limits, _lora_facts(engine),
                            engine.sampling_defaults, engine.arch.labels)
    # Connected before it says it is ready, so that the server's first command finds it.
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(addresses.commands)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(addresses.outputs)
    ready.send_bytes(msg.encode(msg.CoreReady(facts)))
    ready.close()
    core = EngineCore(engine, commands, outputs)
    try:
        core.run()
    finally:
        context.destroy(linger=0)
        engine.shutdown()
    if core.orphaned:
        # The server that made the sockets' folder (and removes it on its own shutdown) was
        # killed: nobody else will.
        _remove_socket_folder(addresses)
    if engine.dead_reason() is not None:
        logger.error("the engine core stops: %s", engine.dead_reason())
        raise SystemExit(1)


def _remove_socket_folder(addresses: CoreAddresses) -> None:
    import shutil
    from pathlib import Path

    folders = {Path(a.removeprefix("ipc://")).parent
               for a in (addresses.commands, addresses.outputs) if a.startswith("ipc://")}
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _lora_facts(engine: LLMEngine) -> msg.LoRAFacts | None:
    keys = engine.adapters
    if keys is None:
        return None
    return msg.LoRAFacts(keys.max_rank, keys.num_layers,
                         [(p, shard, *shape) for (p, shard), shape in keys.shapes.items()])


class EngineCore:
    def __init__(self, engine: LLMEngine, commands, outputs) -> None:
        self.engine = engine
        self._commands = commands  # zmq PULL socket
        self._outputs = outputs  # zmq PUSH socket
        self._parent = os.getppid()
        self.orphaned = False  # set when the loop stopped because the API server is gone
        self._failures: list[msg.RequestFailure] = []

    def run(self) -> None:
        logger.info("engine core process %d started", os.getpid())
        self._send([])  # the first stats, for /metrics
        while True:
            busy = self.engine.has_unfinished_requests()
            commands = self._receive(block=not busy)
            if commands is None:
                return
            for command in commands:
                if isinstance(command, msg.Shutdown):
                    return
                self._apply(command)
            outputs = self._step() if self.engine.has_unfinished_requests() else []
            if outputs or self._failures or commands:
                self._send(outputs)
            if self.engine.dead_reason() is not None:
                return

    def _receive(self, block: bool) -> list[msg.Command] | None:
        """Every queued command; while idle, waits for the first. None: the parent died, or
        a tensor-parallel rank did."""
        import zmq

        commands = []
        while block and not self._commands.poll(_IDLE_POLL_MS):
            if os.getppid() != self._parent:
                logger.warning("the API server process is gone; the engine core stops")
                self.orphaned = True
                return None
            if self.engine.dead_reason() is not None:
                return None
        while True:
            try:
                commands.append(msg.decode_command(self._commands.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return commands

    def _apply(self, command: msg.Command) -> None:
        if isinstance(command, msg.Control):
            self._control(command)
            return
        if isinstance(command, msg.AbortRequests):
            for request_id in command.request_ids:
                self.engine.abort_request(request_id)
            return
        if isinstance(command, msg.RemoveLoRA):
            self.engine.remove_lora(command.lora_int_id)
            return
        for new in command.requests:
            try:
                self.engine.add_request(new.prompt_token_ids, new.engine_params,
                                        new.request_id, new.lora_request, new.priority)
            except ValueError as exc:  # checked in the server already; refused here alone
                self._failures.append(msg.RequestFailure(
                    new.request_id, str(exc), getattr(exc, "param", None), kind="invalid"))
            except EngineSleepingError as exc:  # sent before the server heard of the sleep
                self._failures.append(msg.RequestFailure(new.request_id, str(exc),
                                                         kind="asleep"))

    def _control(self, command: msg.Control) -> None:
        """Run a sleep-mode call or the prefix-cache reset and answer it; a refusal (requests
        running, sleep mode off, a bad level) is the answer's error, the loop goes on."""
        result, error = True, None
        try:
            if isinstance(command, msg.ResetPrefixCache):
                result = self.engine.reset_prefix_cache()
            elif isinstance(command, msg.Sleep):
                self.engine.sleep(command.level)
            else:
                self.engine.wake_up(command.tags)
        except (ValueError, RuntimeError) as exc:
            result, error = False, str(exc)
        self._outputs.send(msg.encode(msg.ControlDone(
            command.call_id, result, self.engine.is_sleeping(), error)))

    def _step(self) -> list[msg.RequestDelta]:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            request_ids = list(self.engine.outputs.requests)
            logger.exception("engine step failed; aborting the %d requests in flight",
                             len(request_ids))
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            message = f"the engine failed while running this request: " \
                      f"{type(exc).__name__}: {exc}"
            self._failures += [msg.RequestFailure(r, message) for r in request_ids]
            return []
        # A grammar over the compile budget is the request's fault: a 400, not an output.
        refused = self.engine.refused
        self._failures += [msg.RequestFailure(r, str(exc), exc.param, kind="invalid")
                           for r, exc in refused.items()]
        return [msg.RequestDelta.of(o) for o in outputs if o.request_id not in refused]

    def _send(self, outputs: list[msg.RequestDelta]) -> None:
        failures, self._failures = self._failures, []
        self._outputs.send(msg.encode(msg.CoreOutputs(outputs, failures, self.engine.stats())))
