"""vLLM's development endpoints, for RL frameworks that drive the server between training
steps: ``POST /reset_prefix_cache``, ``POST /sleep?level=``, ``POST /wake_up?tags=`` and
``GET /is_sleeping``. Served only with ``--enable-server-dev-mode`` (or vLLM's
``VLLM_SERVER_DEV_MODE=1``); without it they are 404s, as in vLLM. Each acts on the model
that ``?model=`` names, or on every served model.

Sleep needs the model's engine started with ``--enable-sleep-mode``. While a model sleeps,
its completion requests get a 503 at once; a refused call (requests running, a bad level or
tag, sleep mode off) is a 400 naming why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from pagedserve.engine import core_messages as msg
from pagedserve.engine.core_client import EngineDeadError
from pagedserve.server.errors import SERVER_ERROR, APIError, bad_request
from pagedserve.server.serving_models import ServedModel, ServingModels


@dataclass
class DevServing:
    models: ServingModels

    async def reset_prefix_cache(self, model: str | None) -> dict:
        """400 if a model's engine has requests in flight (it resets nothing then)."""
        for served in self._targets(model):
            done = await _call(served, msg.ResetPrefixCache)
            if not done.result:
                raise bad_request(f"model {served.name!r}: the prefix cache was not reset: "
                                  "requests are in flight (or a KV offloading tier is on)")
        return {"success": True}

    async def sleep(self, level: int, model: str | None) -> dict:
        for served in self._targets(model):
            await _call(served, lambda call_id: msg.Sleep(call_id, level))
        return {"success": True}

    async def wake_up(self, tags: list[str] | None, model: str | None) -> dict:
        for served in self._targets(model):
            await _call(served, lambda call_id: msg.WakeUp(call_id, tags))
        return {"success": True}

    def is_sleeping(self, model: str | None) -> dict:
        """True if any of the models asked about sleeps."""
        return {"is_sleeping": any(s.client.engine.sleeping for s in self._targets(model))}

    def _targets(self, model: str | None) -> list[ServedModel]:
        return list(self.models) if model is None else [self.models.base(model)]


async def _call(served: ServedModel, make: Callable[[int], msg.Control]) -> msg.ControlDone:
    try:
        done = await served.client.engine.control(make)
    except EngineDeadError as exc:
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), type=SERVER_ERROR) from exc
    if done.error is not None:
        raise bad_request(f"model {served.name!r}: {done.error}")
    return done
