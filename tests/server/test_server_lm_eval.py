"""A real evaluation harness against the server: lm-eval's ``local-completions`` model scores a
small multiple-choice task from a local JSON file (log-likelihoods through ``echo`` and
``logprobs``, several prompts per request), and its numbers equal the offline engine's."""

from __future__ import annotations

import json

import pytest

from pagedserve import SamplingParams

DOCS = [
    {"context": "the quick brown", "choices": [" fox", " dog", " world"], "answer": 0},
    {"context": "hello", "choices": [" world", " paged attention"], "answer": 0},
    {"context": "serving large language", "choices": [" models fast", " café"], "answer": 1},
]
TASK = """task: pagedserve_scoring
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


@pytest.fixture
def task_dir(tmp_path, monkeypatch):
    # Nothing may come from a hub: the data is a local file, the tokenizer a local folder.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "pagedserve_scoring.yaml").write_text(TASK.format(data=data))
    return tmp_path


def test_lm_eval_loglikelihoods_equal_the_offline_engine(server, offline, chat_model, task_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=dict(base_url=f"{server.url}/v1/completions", model="model",
                        tokenizer=str(chat_model), tokenizer_backend="huggingface",
                        tokenized_requests=True, batch_size=4, max_length=1024),
        tasks=["pagedserve_scoring"], task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True, bootstrap_iters=0)
    samples = results["samples"]["pagedserve_scoring"]
    tokenizer = offline.get_tokenizer()
    scored = 0
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"],
                                                     strict=True):
            loglikelihood = response[0][0]
            assert loglikelihood == pytest.approx(
                _offline_loglikelihood(offline, tokenizer, context, continuation), abs=1e-3)
            scored += 1
    assert scored == sum(len(d["choices"]) for d in DOCS)
    assert "acc,none" in results["results"]["pagedserve_scoring"]


def _offline_loglikelihood(offline, tokenizer, context: str, continuation: str) -> float:
    """Sum of the continuation's prompt logprobs, split as lm-eval splits the pair."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    num_context = len(tokenizer.encode(context, add_special_tokens=False))
    out = offline.generate([whole], SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
    return sum(out.prompt_logprobs[i][whole[i]].logprob for i in range(num_context, len(whole)))
