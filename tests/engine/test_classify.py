"""``LLM.classify`` on sequence classifiers (``LlamaForSequenceClassification``,
``Qwen2ForSequenceClassification``, ``Qwen3ForSequenceClassification``: transformers' own
random checkpoints, ``model.*`` and ``score.weight``) against transformers'
``AutoModelForSequenceClassification`` in float64: softmax over 3 labels, sigmoid over 1, on
batches of prompts of several lengths, the longer ones in chunks; their raw logits with
``use_activation=False``; the activation a saved cross-encoder names; ``--runner auto`` pools
them, and the requests a classifier or an embedding model refuses."""

from __future__ import annotations

import pytest
import torch

from pagedserve import PoolingParams, SamplingParams
from pagedserve.errors import ConfigError
from pagedserve.sampling_params import InvalidSamplingParam
from tests.engine.test_pooling import LENGTHS, _assert_all_blocks_free, _assert_close
from tests.tiny_models import (
    hf_classified,
    hf_logits,
    make_llm,
    random_prompts,
    write_tiny_model,
)


@pytest.fixture(scope="module", params=["llama3-3", "qwen2-3", "qwen3-1", "llama3-1"])
def classifier(request, tmp_path_factory):
    arch, _, labels = request.param.partition("-")
    return write_tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch, seed=5,
                            num_labels=int(labels))


def _probs(llm, prompts, **kwargs) -> list[torch.Tensor]:
    outs = llm.classify(prompts, use_tqdm=False, **kwargs)
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.prompt_token_ids == prompt and out.finished
        assert out.outputs.num_classes == llm.engine.arch.num_labels
    return [torch.tensor(o.outputs.probs, dtype=torch.float64) for o in outs]


def test_classify_matches_transformers(classifier):
    """``--runner auto`` pools a classifier; a budget of 32 tokens runs the longer prompts in
    chunks over several steps, all at once and one by one."""
    prompts = random_prompts("classify", LENGTHS)
    llm = make_llm(classifier, max_num_batched_tokens=32)
    assert llm.engine.config.runner == "pooling"
    runner = llm.engine.executor.runner
    assert runner.model.lm_head is None and runner.model.score is not None
    want = hf_classified(classifier, prompts)
    # Random labels are near-uniform: the probabilities differ from prompt to prompt, so a
    # wrong row read (the first token's, another prompt's) shows.
    assert max(float((w - want[0]).abs().max()) for w in want) > 1e-3
    _assert_close(_probs(llm, prompts), want)
    _assert_close([_probs(llm, [p])[0] for p in prompts], want)
    if llm.engine.arch.num_labels > 1:
        assert all(abs(float(p.sum()) - 1) < 1e-5 for p in want)
    _assert_all_blocks_free(llm)


def test_raw_logits_match_transformers(classifier):
    """``use_activation=False`` returns the score head's raw logits, transformers' own; None
    and True still return probabilities; one batch mixes both, row by row."""
    prompts = random_prompts("logits", LENGTHS)
    llm = make_llm(classifier, max_num_batched_tokens=32)
    logits, probs = hf_logits(classifier, prompts), hf_classified(classifier, prompts)
    # Logits are no probabilities: an activation applied anyway shows.
    assert max(float((w - p).abs().max()) for w, p in zip(logits, probs)) > 0.05
    raw = PoolingParams(use_activation=False)
    _assert_close(_probs(llm, prompts, pooling_params=raw), logits)
    _assert_close(_probs(llm, prompts, pooling_params=PoolingParams(use_activation=True)),
                  probs)
    mixed = [raw if i % 2 else PoolingParams() for i in range(len(prompts))]
    _assert_close(_probs(llm, prompts, pooling_params=mixed),
                  [w if i % 2 else p for i, (w, p) in enumerate(zip(logits, probs))])
    _assert_all_blocks_free(llm)


IDENTITY, TANH = "torch.nn.modules.linear.Identity", "torch.nn.modules.activation.Tanh"


@pytest.mark.parametrize("saved, activation", [
    ({"sbert_ce_default_activation_function": IDENTITY}, lambda x: x),
    ({"sbert_ce_default_activation_function": TANH}, torch.tanh),
    # sentence-transformers v4's place wins over the older key
    ({"sentence_transformers": {"activation_fn": TANH},
      "sbert_ce_default_activation_function": IDENTITY}, torch.tanh),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}},
     torch.sigmoid),
    # a problem_type picks the activation first
    ({"problem_type": "regression", "sbert_ce_default_activation_function": TANH},
     lambda x: x),
])
def test_saved_cross_encoder_activation(tmp_path, saved, activation):
    """A cross-encoder's activation as sentence-transformers saves it in config.json, read as
    vLLM reads it; ``use_activation=False`` still returns the raw logits."""
    folder = write_tiny_model(tmp_path / "m", "llama3", seed=7, num_labels=1, **saved)
    prompts = random_prompts("saved", [5, 17])
    llm = make_llm(folder)
    logits = hf_logits(folder, prompts)
    _assert_close(_probs(llm, prompts), [activation(w) for w in logits])
    _assert_close(_probs(llm, prompts, pooling_params=PoolingParams(use_activation=False)),
                  logits)


@pytest.mark.parametrize("name", ["torch.nn.modules.activation.ReLU", "builtins.print"])
def test_saved_activation_we_do_not_run_is_refused(tmp_path, name):
    folder = write_tiny_model(tmp_path / "m", "llama3", seed=7, num_labels=1,
                              sbert_ce_default_activation_function=name)
    with pytest.raises(ValueError, match=f"activation '{name}' is not one pagedserve runs"):
        make_llm(folder)


def test_classifier_refusals(classifier):
    """A classifier neither embeds nor generates; an embedding model does not classify."""
    llm = make_llm(classifier)
    assert llm.engine.arch.checkpoint_architecture.endswith("ForSequenceClassification")
    with pytest.raises(ValueError, match="sequence classifier.*/classify"):
        llm.embed([[5, 6]], use_tqdm=False)
    with pytest.raises(ValueError, match="--runner pooling"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ConfigError, match="sequence classifier with no LM head.*--runner "
                                          "pooling"):
        make_llm(classifier, runner="generate")
    with pytest.raises(ValueError, match="dimensions cuts an embedding"):
        llm.classify([[5, 6]], pooling_params=PoolingParams(dimensions=2), use_tqdm=False)
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingParams(task="reward")
    with pytest.raises(InvalidSamplingParam, match="use_activation must be a boolean") as err:
        PoolingParams(use_activation="false")
    assert err.value.param == "use_activation"
    kept = llm.classify([random_prompts(3, [40])[0]], truncate_prompt_tokens=10,
                        use_tqdm=False)[0]
    assert len(kept.prompt_token_ids) == 10


def test_embedding_and_generating_models_do_not_classify(tmp_path):
    folder = write_tiny_model(tmp_path / "m", "llama3", seed=5)
    embedder = make_llm(folder, runner="pooling")
    with pytest.raises(ValueError, match="not a sequence classifier"):
        embedder.classify([[5, 6]], use_tqdm=False)
    with pytest.raises(ValueError, match="use_activation is a classifier's"):
        embedder.embed([[5, 6]], pooling_params=PoolingParams(use_activation=False),
                       use_tqdm=False)
    with pytest.raises(ValueError, match="classification need .*--runner pooling"):
        make_llm(folder).classify([[5, 6]], use_tqdm=False)


def test_score_with_a_cross_encoder(classifier):
    """vLLM's cross-encoder scoring with a classifier of one label: each pair joined by the
    tokenizer's pair encoding, scored by its sigmoid probability; 1:N and N:N. A classifier
    of several labels scores nothing."""
    from transformers import AutoTokenizer

    llm = make_llm(classifier)
    if llm.engine.arch.num_labels != 1:
        with pytest.raises(ValueError, match="sequence classifier"):
            llm.score("a", ["b"], use_tqdm=False)
        return
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    query, docs = "what is paged attention", ["a kv cache in blocks", "hello world " * 9]
    joined = [tokenizer(query, d)["input_ids"] for d in docs]
    want = [float(p[0]) for p in hf_classified(classifier, joined)]
    for got in (llm.score(query, docs, use_tqdm=False),
                llm.score([query, query], docs, use_tqdm=False)):
        assert [o.prompt_token_ids for o in got] == joined
        assert [o.outputs.score for o in got] == pytest.approx(want, abs=2e-5)
    raw = [float(w[0]) for w in hf_logits(classifier, joined)]
    got = llm.score(query, docs, pooling_params=PoolingParams(use_activation=False),
                    use_tqdm=False)
    assert [o.outputs.score for o in got] == pytest.approx(raw, abs=2e-5)
    assert raw != pytest.approx(want, abs=0.05)
    with pytest.raises(TypeError, match="takes texts"):
        llm.score([5, 6], [[7]], use_tqdm=False)
    _assert_all_blocks_free(llm)

