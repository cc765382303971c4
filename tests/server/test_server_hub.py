"""``pagedserve serve ORG/NAME`` on a model in a hub cache, offline: the API server resolves the
id, the engine core loads the same snapshot, and a chat answer equals ``LLM.chat``'s on the
original folder."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve import SamplingParams
from tests.hub_cache import NEW, add_to_cache
from tests.server.conftest import launch_server

pytestmark = pytest.mark.slow


def test_serve_a_hub_id_from_the_cache(chat_model, offline, tmp_path):
    cache = tmp_path / "hub"
    add_to_cache(cache, "org/chat", chat_model, NEW)
    messages = [{"role": "user", "content": "hello world"}]
    expected = offline.chat(messages, SamplingParams(max_tokens=10, temperature=0),
                            use_tqdm=False)[0].outputs[0].text
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    with launch_server("org/chat", tmp_path, env=env) as server:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["org/chat"]
        assert client.models.retrieve("org/chat").id == "org/chat"
        got = client.chat.completions.create(model="org/chat", messages=messages,
                                             max_tokens=10, temperature=0)
    assert got.choices[0].message.content == expected


def test_serve_a_missing_hub_id_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "org/absent",
                           "--device", "cpu"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"pagedserve: error: model org/absent is not in the Hugging Face cache {tmp_path} and "
        "the hub cannot be reached (HF_HUB_OFFLINE=1 or no network); download it once online, "
        "or point HF_HUB_CACHE at a cache that holds it")
