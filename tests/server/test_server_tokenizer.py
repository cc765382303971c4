"""--tokenizer on the server: the API server process (chat templates, /tokenize) and the engine
core (detokenizing) both read the folder it names, not the model's own tokenizer files."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve import SamplingParams
from tests.engine.test_tokenizer_option import without_tokenizer
from tests.server.conftest import launch_server

MESSAGES = [{"role": "user", "content": "hello world, paged attention"}]


@pytest.fixture(scope="module")
def broken(chat_model, tmp_path_factory):
    return without_tokenizer(chat_model, tmp_path_factory.mktemp("tok") / "broken")


@pytest.fixture(scope="module")
def tokenizer_server(broken, chat_model, tmp_path_factory):
    with launch_server(broken, tmp_path_factory.mktemp("logs"), "--tokenizer",
                       str(chat_model)) as s:
        yield s


def test_tokenize_and_chat_read_the_tokenizer_folder(tokenizer_server, offline):
    tokenizer = offline.get_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    response = tokenizer_server.post("/tokenize", json={"messages": MESSAGES})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == tokens
    response = tokenizer_server.post("/tokenize", json={"prompt": "the quick brown fox"})
    assert response.json()["tokens"] == tokenizer.encode("the quick brown fox")
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    want = offline.chat(MESSAGES, greedy, use_tqdm=False)[0].outputs[0].text
    response = tokenizer_server.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == want


def test_serve_with_a_missing_tokenizer_path_exits_with_one_line(broken, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "serve", str(broken), "--device", "cpu",
         "--tokenizer", str(tmp_path / "nowhere")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedserve: error: --tokenizer ") and "does not exist" in last
    assert "Traceback" not in result.stderr
