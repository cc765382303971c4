"""``pagedserve bench structured`` at its smallest sizes: two requests (one free, one
constrained, the fewest that compare the halves) run to the end and write their JSON."""

from __future__ import annotations

import json

from pagedserve.cli import build_parser
from tests.tiny_models import write_tiny_model

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_two_requests_run_to_the_end(tmp_path):
    from transformers import AutoTokenizer

    from pagedserve.bench import structured

    folder = write_tiny_model(tmp_path / "model", "llama3")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    out = tmp_path / "structured.json"
    structured.main(build_parser().parse_args([
        "bench", "structured", "--model", str(folder), "--device", "cpu",
        "--kv-cache-memory-bytes", str(4 << 20), "--num-requests", "2", "--output-len", "2",
        "--repeats", "1", "--grammar-compile-workers", "1", "--out", str(out)]))
    result = json.loads(out.read_text())
    assert result["num_requests"] == 2
    assert {"tpot_free_ms", "tpot_constrained_ms"} <= result["runs"][1].keys()
