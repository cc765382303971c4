"""LoRA adapters behind the API: ``--lora-modules`` at start-up and vLLM's
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` at run time.

Every adapter is read and checked here (its config, its weights, its rank against
``--max-lora-rank`` and its shapes against the model's) before its name is served, so the
engine core is never handed one it cannot run. Each adapter gets a ``lora_int_id`` of its own
on its base model's core: a new one from the server's counter, or the one the load request
gives if that core holds no adapter of that id. Unloading takes the name away at once
(requests naming it get 404s); the requests already in flight on it finish, and the core
forgets the adapter after the last of them (``EngineCoreClient.remove_lora``).

Which base model an adapter belongs to: the one ``base_model_name`` names, else the one served
model with LoRA on; with several, ``base_model_name`` must say.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus

from fastapi.responses import PlainTextResponse

from pagedserve.errors import ConfigError
from pagedserve.lora.request import LoRARequest
from pagedserve.server.args import LoRAModule
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedserve.server.serving_models import ServedAdapter, ServedModel, ServingModels


@dataclass
class LoRAServing:
    models: ServingModels
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def add_modules(self, modules: Sequence[LoRAModule]) -> None:
        """Serve ``--lora-modules``; a ``ConfigError`` (one line) for the first that cannot
        be served."""
        for module in modules:
            try:
                base = self._base(module.base_model_name)
                request = self._request(base, module.name, module.path, None)
                _check(base, request)
                self.models.add_adapter(ServedAdapter(request, base))
            except APIError as exc:
                raise ConfigError(f"--lora-modules {module.name}: {exc}") from None

    async def load(self, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        base = self._base(body.base_model_name)
        request = self._request(base, body.lora_name, body.lora_path, body.lora_int_id)
        # Reading the weights takes a while: off the event loop.
        await asyncio.to_thread(_check, base, request)
        # Checked again: another load may have taken the name or the id meanwhile.
        self._request(base, body.lora_name, body.lora_path, request.lora_int_id)
        self.models.add_adapter(ServedAdapter(request, base))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    async def unload(self, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        adapter = self.models.adapter(body.lora_name)
        if adapter is None or body.lora_int_id not in (None, adapter.request.lora_int_id):
            with_id = "" if body.lora_int_id is None else f" with lora_int_id {body.lora_int_id}"
            raise APIError(HTTPStatus.NOT_FOUND, f"The lora adapter '{body.lora_name}'"
                           f"{with_id} cannot be found.", param="lora_name",
                           code="model_not_found")
        self.models.remove_adapter(adapter.name)
        adapter.base.client.engine.remove_lora(adapter.request.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")

    def _base(self, name: str | None) -> ServedModel:
        if name is not None:
            model = self.models.base(name)
            if model.lora is None:
                raise bad_request(f"the model {name!r} serves no LoRA adapters; start it with "
                                  "--enable-lora", param="base_model_name")
            return model
        with_lora = [m for m in self.models if m.lora is not None]
        if len(with_lora) == 1:
            return with_lora[0]
        if not with_lora:
            raise bad_request("LoRA is off; start the server with --enable-lora")
        names = ", ".join(repr(m.name) for m in with_lora)
        raise bad_request(f"several models serve LoRA adapters ({names}); name the adapter's "
                          "in base_model_name", param="base_model_name")

    def _request(self, base: ServedModel, name: str, path: str,
                 lora_int_id: int | None) -> LoRARequest:
        """The adapter's engine request, once its name and id are free; 400 if either is
        not."""
        if self.models.adapter(name) is not None:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.",
                              param="lora_name")
        if self.models.name_in_use(name):
            raise bad_request(f"the name {name!r} is a served model's", param="lora_name")
        if lora_int_id is None:
            lora_int_id = next(i for i in self._ids if not self._id_in_use(base, i))
        elif self._id_in_use(base, lora_int_id):
            raise bad_request(f"lora_int_id {lora_int_id} is in use on {base.name!r}",
                              param="lora_int_id")
        return LoRARequest(name, lora_int_id, path)

    def _id_in_use(self, base: ServedModel, lora_int_id: int) -> bool:
        return base.client.engine.lora_in_use(lora_int_id) or any(
            a.base is base and a.request.lora_int_id == lora_int_id
            for a in self.models.adapters())


def _check(base: ServedModel, request: LoRARequest) -> None:
    """400 naming what is wrong unless the adapter reads and fits ``base``."""
    try:
        base.lora.check(request.lora_name, request.lora_path)
    except (ValueError, OSError) as exc:
        raise bad_request(str(exc), param="lora_path") from exc
