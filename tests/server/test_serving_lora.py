"""Which base model an adapter belongs to, its ids, and ``--lora-modules``' two forms, without a
server: served models whose adapter check is a stub."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.errors import ConfigError
from pagedserve.server.args import LoRAModule, add_server_args
from pagedserve.server.errors import APIError
from pagedserve.server.serving_lora import LoRAServing
from pagedserve.server.serving_models import ServedModel, ServingModels
from tests.server.conftest import KV_BYTES, MAX_MODEL_LEN


class StubLoRA:
    """``LoRAFacts`` that accepts every adapter and records what it checked."""

    def __init__(self) -> None:
        self.checked: list[tuple[str, str]] = []

    def check(self, name: str, path: str) -> None:
        self.checked.append((name, path))


class StubEngine:
    def __init__(self, in_use: set[int] = frozenset()) -> None:
        self.in_use = set(in_use)

    def lora_in_use(self, lora_int_id: int) -> bool:
        return lora_int_id in self.in_use


class StubClient:
    def __init__(self) -> None:
        self.engine = StubEngine()


def _model(name: str, lora: bool) -> ServedModel:
    return ServedModel(name, 128, None, StubClient(), StubLoRA() if lora else None)


def _serving(*models: ServedModel) -> LoRAServing:
    return LoRAServing(ServingModels(list(models)))


def test_modules_go_to_the_one_model_with_lora():
    plain, with_lora = _model("plain", False), _model("tuned", True)
    loras = _serving(plain, with_lora)
    loras.add_modules([LoRAModule("a", "/a"), LoRAModule("b", "/b", "tuned")])
    routes = [loras.models.resolve(n) for n in ("a", "b")]
    assert [(r.name, r.model.name, r.lora.lora_int_id, r.lora.lora_path) for r in routes] == [
        ("a", "tuned", 1, "/a"), ("b", "tuned", 2, "/b")]
    assert with_lora.lora.checked == [("a", "/a"), ("b", "/b")]
    assert loras.models.resolve(None).lora is None  # the first model, no adapter


def test_with_several_models_with_lora_base_model_name_must_say():
    first, second = _model("first", True), _model("second", True)
    loras = _serving(first, second)
    with pytest.raises(ConfigError, match=r"--lora-modules a: several models serve LoRA "
                                          r"adapters \('first', 'second'\); name the adapter's "
                                          r"in base_model_name"):
        loras.add_modules([LoRAModule("a", "/a")])
    loras.add_modules([LoRAModule("a", "/a", "second")])
    assert loras.models.resolve("a").model is second
    assert [c.parent for c in loras.models.models().data] == [None, None, "second"]


@pytest.mark.parametrize(("models", "module", "says"), [
    ([("plain", False)], LoRAModule("a", "/a"), "LoRA is off; start the server with "
                                                "--enable-lora"),
    ([("plain", False), ("tuned", True)], LoRAModule("a", "/a", "plain"),
     "the model 'plain' serves no LoRA adapters"),
    ([("tuned", True)], LoRAModule("a", "/a", "absent"), "the model 'absent' does not exist"),
    ([("tuned", True)], LoRAModule("tuned", "/a"), "the name 'tuned' is a served model's"),
])
def test_modules_that_cannot_be_served(models, module, says):
    with pytest.raises(ConfigError, match=f"--lora-modules {module.name}: {says}"):
        _serving(*[_model(n, lora) for n, lora in models]).add_modules([module])


def test_ids_are_per_core_and_skip_those_in_use():
    model = _model("tuned", True)
    model.client.engine.in_use = {1}  # an unloaded adapter's request is still running
    loras = _serving(model)
    loras.add_modules([LoRAModule("a", "/a")])
    assert loras.models.resolve("a").lora.lora_int_id == 2
    with pytest.raises(APIError, match="lora_int_id 1 is in use on 'tuned'"):
        loras._request(model, "b", "/b", 1)
    with pytest.raises(APIError, match="lora_int_id 2 is in use"):
        loras._request(model, "b", "/b", 2)


def test_a_load_with_an_id_past_int64_is_refused_by_its_field():
    """2**64 was loaded; every request on it, and its unload, was then a 500 (OverflowError
    sending the id to the core). The field's bound makes it a 400 naming lora_int_id."""
    from pydantic import ValidationError

    from pagedserve.server.protocol import LoadLoRAAdapterRequest

    body = {"lora_name": "a", "lora_path": "/a"}
    assert LoadLoRAAdapterRequest(**body, lora_int_id=2**63 - 1).lora_int_id == 2**63 - 1
    with pytest.raises(ValidationError) as exc:
        LoadLoRAAdapterRequest(**body, lora_int_id=2**64)
    assert exc.value.errors()[0]["loc"] == ("lora_int_id",)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_server_args(parser)
    return parser.parse_args(argv)


def test_lora_modules_take_both_forms():
    args = _parse("--lora-modules", "a=/x=y", '{"name": "b", "path": "/p"}',
                  "--lora-modules", '{"name": "c", "path": "/q", "base_model_name": "m"}',
                  "--enable-runtime-lora-updating")
    assert args.lora_modules == [LoRAModule("a", "/x=y"), LoRAModule("b", "/p"),
                                 LoRAModule("c", "/q", "m")]
    assert args.enable_runtime_lora_updating


@pytest.mark.parametrize("text", ["a", "=/p", "a=", '{"name": "a"}', '{"name": 1, "path": "p"}',
                                  '{"name": "a", "path": "p", "rank": 8}', "{not json"])
def test_bad_lora_modules_are_refused(text):
    with pytest.raises(argparse.ArgumentError, match="--lora-modules"):
        _parse("--lora-modules", text)


@pytest.mark.slow  # an engine core starts first
def test_a_module_that_cannot_be_read_fails_the_start_in_one_line(chat_model, tmp_path: Path):
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "pagedserve.cli", "serve", str(chat_model), "--device", "cpu",
             "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(KV_BYTES),
             "--enable-lora", "--lora-modules", f"gone={tmp_path / 'absent'}"],
            stdout=out, stderr=subprocess.STDOUT, timeout=180)
    assert done.returncode == 2
    last = log.read_text().strip().splitlines()[-1]
    assert last == (f"pagedserve: error: --lora-modules gone: LoRA adapter "
                    f"{tmp_path / 'absent'}: no such folder")


def test_modules_without_enable_lora_fail_before_any_model_loads(tmp_path: Path, capsys):
    from pagedserve.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tmp_path / "no-model-here"), "--lora-modules", f"a={tmp_path}"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "pagedserve: error: --lora-modules a: LoRA is off; start the server with --enable-lora")
