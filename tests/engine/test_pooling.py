"""``runner="pooling"``: ``LLM.embed`` against transformers' base model (``last_hidden_state``,
after the final norm) pooled by hand in float64; chunked prompts, batches, the engine's
state after, and the errors of a request on the wrong runner. Each runs on ``*ForCausalLM``
checkpoints and on bare base models (``LlamaModel``, ``MistralModel``, ``Qwen2Model``,
``Qwen3Model``: no LM head, tensor names without ``model.``), as embedding models are
published; then
sentence-transformers' pooling defaults (``modules.json``, ``1_Pooling/config.json``),
Matryoshka ``dimensions`` (cut, then normalized) and request priorities."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve import PoolingParams, SamplingParams
from pagedserve.errors import ConfigError
from pagedserve.models.config import ModelArchConfig
from tests.tiny_models import hf_pooled, make_llm, random_prompts, write_tiny_model

# float32 engine against a float64 reference, over a 2-layer model of width 64.
ATOL = 2e-5
LENGTHS = [1, 5, 23, 64, 97]


# An architecture, and "-base" for its bare base model (as e5-mistral and gte publish them).
@pytest.fixture(scope="module", params=["llama3", "qwen2", "llama3-base", "mistral-base",
                                        "qwen2-base", "qwen3-base"])
def model(request, tmp_path_factory):
    arch, _, base = request.param.partition("-")
    return write_tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch, seed=3,
                            base_model=bool(base))


def _is_base_model(folder) -> bool:
    return not json.loads((folder / "config.json").read_text())["architectures"][0].endswith(
        "ForCausalLM")


def _embeddings(llm, prompts, **kwargs) -> list[torch.Tensor]:
    outs = llm.embed(prompts, use_tqdm=False, **kwargs)
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.prompt_token_ids == prompt and out.finished
    return [torch.tensor(o.outputs.embedding, dtype=torch.float64) for o in outs]


def _assert_close(got, want) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, i
        assert torch.allclose(g, w, atol=ATOL, rtol=0), (i, (g - w).abs().max().item())


def _assert_all_blocks_free(llm) -> None:
    pool = llm.engine.kv.pool
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting
    assert pool.num_used == 0 and pool.num_free == pool.num_blocks


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embed_matches_transformers(model, pooling_type, normalize):
    prompts = random_prompts(f"{pooling_type}{normalize}", LENGTHS)
    # A budget of 32 tokens: the longer prompts run in chunks over several steps.
    llm = make_llm(model, runner="pooling", max_num_batched_tokens=32,
                   pooler_config={"pooling_type": pooling_type, "normalize": normalize})
    want = hf_pooled(model, prompts, pooling_type, normalize)
    _assert_close(_embeddings(llm, prompts), want)  # all at once
    _assert_close([_embeddings(llm, [p])[0] for p in prompts], want)  # one by one
    _assert_all_blocks_free(llm)


def test_a_chunk_one_short_of_the_prompt_end(model):
    """32 tokens split 9, 7, 9, 7 leave the first prompt one token: the next step's fast
    path for that token sampled it (logits from a model with no LM head, a RuntimeError)."""
    prompts = random_prompts(1, [10, 7, 12, 7])
    llm = make_llm(model, runner="pooling", max_num_batched_tokens=32)
    _assert_close(_embeddings(llm, prompts), hf_pooled(model, prompts, "LAST", True))
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_chunked_equals_unchunked(model, pooling_type):
    prompts = random_prompts(7, [300, 130])
    config = {"pooling_type": pooling_type}
    chunked = make_llm(model, runner="pooling", max_num_batched_tokens=48,
                       pooler_config=config)
    whole = make_llm(model, runner="pooling", max_num_batched_tokens=1024,
                     pooler_config=config)
    _assert_close(_embeddings(chunked, prompts), _embeddings(whole, prompts))
    _assert_all_blocks_free(chunked)


def test_prefix_cache_hits_keep_last_pooling_exact(model):
    """A second prompt sharing a cached prefix computes only its tail; LAST reads its last
    row, which is always computed."""
    base = random_prompts(11, [80])[0]
    prompts = [base + [5, 6, 7], base + [9]]
    llm = make_llm(model, runner="pooling")
    first = _embeddings(llm, prompts[:1])
    second = _embeddings(llm, prompts[1:])
    assert llm.engine.kv.prefix_stats.hit_tokens > 0
    _assert_close(first + second, hf_pooled(model, prompts, "LAST", True))


def test_mean_and_cls_turn_prefix_caching_off(model):
    base = random_prompts(17, [80])[0]
    prompts = [base + [5, 6, 7], base + [9]]
    llm = make_llm(model, runner="pooling", pooler_config='{"pooling_type": "mean"}')
    got = _embeddings(llm, prompts[:1]) + _embeddings(llm, prompts[1:])
    assert llm.engine.kv.prefix_stats.hit_tokens == 0
    _assert_close(got, hf_pooled(model, prompts, "MEAN", True))


def test_pooling_params(model):
    prompts = random_prompts(13, [9, 40])
    llm = make_llm(model, runner="pooling")
    raw = _embeddings(llm, prompts, pooling_params=[PoolingParams(normalize=False),
                                                    PoolingParams()])
    _assert_close(raw[:1], hf_pooled(model, prompts[:1], "LAST", False))
    _assert_close(raw[1:], hf_pooled(model, prompts[1:], "LAST", True))
    kept = llm.embed(prompts[1], truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert kept.prompt_token_ids == prompts[1][-10:]
    _assert_close([torch.tensor(kept.outputs.embedding, dtype=torch.float64)],
                  hf_pooled(model, [prompts[1][-10:]], "LAST", True))
    text = llm.embed("hello world", use_tqdm=False)[0]
    assert text.outputs.hidden_size == 64
    with pytest.raises(ValueError, match="dimensions=32: .*not a Matryoshka model"):
        llm.embed(prompts[0], pooling_params=PoolingParams(dimensions=32), use_tqdm=False)
    assert _embeddings(llm, prompts, pooling_params=PoolingParams(dimensions=64))
    _assert_all_blocks_free(llm)


def test_errors_name_the_runner(model):
    pooling = make_llm(model, runner="pooling")
    with pytest.raises(ValueError, match="--runner pooling"):
        pooling.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="context length"):
        pooling.embed([[5] * 1025], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        pooling.embed([[5, 384]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        pooling.embed([[]], use_tqdm=False)
    assert len(pooling.embed([[5] * 1024], use_tqdm=False)[0].outputs.embedding) == 64
    _assert_all_blocks_free(pooling)
    if _is_base_model(model):  # no LM head: it cannot generate
        with pytest.raises(ConfigError, match="base model with no LM head.*--runner pooling"):
            make_llm(model, runner="generate")
        return
    generating = make_llm(model)
    with pytest.raises(ValueError, match="runner"):
        generating.embed([[5, 6]], use_tqdm=False)


def test_auto_runner(model):
    """``auto`` pools a bare base model (vLLM picks pooling for an ``XModel``) and generates
    with a ``*ForCausalLM`` one."""
    llm = make_llm(model)
    prompts = random_prompts(19, [6, 30])
    if _is_base_model(model):
        assert llm.engine.config.runner == "pooling"
        _assert_close(_embeddings(llm, prompts), hf_pooled(model, prompts, "LAST", True))
    else:
        assert llm.engine.config.runner == "generate"
        assert llm.engine.executor.runner.model.lm_head is not None


def test_pooling_holds_no_lm_head(model):
    """A pooling engine builds the model without its LM head, so a ``*ForCausalLM``
    checkpoint's untied head is skipped, never held; ``--load-format dummy`` makes none."""
    pooling = make_llm(model, runner="pooling")
    runner = pooling.engine.executor.runner
    assert runner.model.lm_head is None
    assert not any(name.startswith("lm_head") for name, _ in runner.model.named_parameters())
    with pytest.raises(RuntimeError, match="without an LM head"):
        runner.model.compute_logits(torch.zeros(1, 64))
    if not _is_base_model(model):
        generating = make_llm(model, runner="generate")
        head = generating.engine.executor.runner.model.lm_head
        untied = 0 if generating.engine.arch.tie_word_embeddings else 384 * 64 * 4
        assert head is not None
        assert (generating.engine.executor.runner.weight_bytes() - runner.weight_bytes()
                == untied)
    dummy = make_llm(model, runner="pooling", load_format="dummy")
    assert dummy.engine.executor.runner.model.lm_head is None
    assert len(dummy.embed([[5, 6, 7]], use_tqdm=False)[0].outputs.embedding) == 64


@pytest.mark.parametrize("config, message", [
    (dict(runner="pooling", pooler_config={"pooling_type": "MAX"}), "pooling_type"),
    (dict(runner="pooling", pooler_config={"pool": "LAST"}), "unknown field"),
    (dict(runner="pooling", pooler_config="{"), "not valid JSON"),
    (dict(runner="generate", pooler_config={"pooling_type": "LAST"}),
     "needs --runner pooling"),
    (dict(runner="embed"), "runner"),
])
def test_bad_options(config, message):
    from pagedserve.config import EngineConfig

    with pytest.raises(ConfigError, match=message):
        EngineConfig(**config)


def _sentence_transformers(folder, modes: dict[str, bool], normalize: bool):
    """Make ``folder`` a sentence-transformers model: ``modules.json`` listing the
    transformer, a Pooling module with ``modes`` in ``1_Pooling/config.json``, and with
    ``normalize`` a Normalize module."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    flags = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
             "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
             "pooling_mode_lasttoken": False, **modes}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    return folder


def test_sentence_transformers_defaults(tmp_path):
    """vLLM's reading of a sentence-transformers folder: ``auto`` pools it (a
    ``*ForCausalLM`` one too), its Pooling flag picks pooling_type, normalization follows a
    Normalize module in modules.json, and each field ``--pooler-config`` names wins."""
    mean = _sentence_transformers(write_tiny_model(tmp_path / "mean", "llama3", seed=5),
                                  {"pooling_mode_mean_tokens": True}, normalize=False)
    prompts = random_prompts(23, [7, 40])
    llm = make_llm(mean)
    assert llm.engine.config.runner == "pooling"
    assert llm.engine.config.pooling.pooling_type == "MEAN"
    _assert_close(_embeddings(llm, prompts), hf_pooled(mean, prompts, "MEAN", False))
    last = make_llm(mean, runner="pooling", pooler_config={"pooling_type": "LAST"})
    _assert_close(_embeddings(last, prompts), hf_pooled(mean, prompts, "LAST", False))
    both = make_llm(mean, pooler_config={"pooling_type": "cls", "normalize": True})
    _assert_close(_embeddings(both, prompts), hf_pooled(mean, prompts, "CLS", True))

    cls = _sentence_transformers(write_tiny_model(tmp_path / "cls", "qwen2", seed=5,
                                                  base_model=True),
                                 {"pooling_mode_cls_token": True}, normalize=True)
    _assert_close(_embeddings(make_llm(cls), prompts), hf_pooled(cls, prompts, "CLS", True))


def test_sentence_transformers_unsupported_mode(tmp_path):
    folder = _sentence_transformers(write_tiny_model(tmp_path / "m", "llama3", seed=5),
                                    {"pooling_mode_max_tokens": True}, normalize=True)
    with pytest.raises(ConfigError, match="pooling_mode_max_tokens.*--pooler-config"):
        make_llm(folder)
    prompts = random_prompts(29, [9])
    llm = make_llm(folder, pooler_config={"pooling_type": "LAST"})
    _assert_close(_embeddings(llm, prompts), hf_pooled(folder, prompts, "LAST", True))


def test_generate_model_refuses_pooler_config_under_auto(tmp_path):
    folder = write_tiny_model(tmp_path / "m", "llama3", seed=5)
    with pytest.raises(ConfigError, match="--pooler-config needs --runner pooling"):
        make_llm(folder, pooler_config={"pooling_type": "MEAN"})


@pytest.fixture(scope="module")
def matryoshka(tmp_path_factory):
    """A bare base model whose config.json lists Matryoshka sizes (vLLM's key)."""
    return write_tiny_model(tmp_path_factory.mktemp("matryoshka") / "m", "qwen2", seed=7,
                            base_model=True, matryoshka_dimensions=[32, 16, 64])


def _cut(vector: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """vLLM's Matryoshka order: keep the first values, then normalize those."""
    kept = vector[:dimensions]
    return torch.nn.functional.normalize(kept, dim=-1) if normalize else kept


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_matryoshka_dimensions(matryoshka, pooling_type):
    """A batch mixing sizes (and normalize), chunked over steps, against transformers'
    unnormalized vectors cut and normalized in float64."""
    prompts = random_prompts(f"mrl{pooling_type}", [6, 40, 70])
    llm = make_llm(matryoshka, runner="pooling", max_num_batched_tokens=32,
                   pooler_config={"pooling_type": pooling_type})
    raw = hf_pooled(matryoshka, prompts, pooling_type, normalize=False)
    params = [PoolingParams(dimensions=16), PoolingParams(dimensions=32, normalize=False),
              PoolingParams()]
    _assert_close(_embeddings(llm, prompts, pooling_params=params),
                  [_cut(raw[0], 16, True), _cut(raw[1], 32, False), _cut(raw[2], 64, True)])
    _assert_close(_embeddings(llm, prompts, pooling_params=PoolingParams(dimensions=32)),
                  [_cut(r, 32, True) for r in raw])
    _assert_all_blocks_free(llm)


def test_matryoshka_sizes_are_checked(matryoshka, tmp_path):
    listed = make_llm(matryoshka, runner="pooling")
    for dimensions in (0, 8, 48, 65):
        with pytest.raises(ValueError, match=f"dimensions={dimensions}: .*16, 32, 64"):
            listed.embed([[5, 6]], pooling_params=PoolingParams(dimensions=dimensions),
                         use_tqdm=False)
    _assert_all_blocks_free(listed)
    # is_matryoshka alone: any size from 1 to the hidden size.
    anysize = write_tiny_model(tmp_path / "any", "llama3", seed=7, is_matryoshka=True)
    llm = make_llm(anysize, runner="pooling")
    for dimensions in (0, 65):
        with pytest.raises(ValueError, match=f"dimensions={dimensions} must be from 1 to .*64"):
            llm.embed([[5, 6]], pooling_params=PoolingParams(dimensions=dimensions),
                      use_tqdm=False)
    prompts = random_prompts("any", [5, 12])
    raw = hf_pooled(anysize, prompts, "LAST", normalize=False)
    got = _embeddings(llm, prompts, pooling_params=[PoolingParams(dimensions=1),
                                                    PoolingParams(dimensions=5)])
    _assert_close(got, [_cut(raw[0], 1, True), _cut(raw[1], 5, True)])
    config = json.loads((anysize / "config.json").read_text())
    with pytest.raises(ValueError, match="matryoshka_dimensions must be a list of positive"):
        ModelArchConfig.from_hf_dict({**config, "matryoshka_dimensions": [16, 0]})


def test_embed_priority(matryoshka):
    """Priorities are served under the priority policy, as ``generate``'s; fcfs refuses any
    other than 0 with generation's error, and the batch is left out whole."""
    prompts = random_prompts("priority", [9, 30, 4])
    llm = make_llm(matryoshka, runner="pooling", scheduling_policy="priority",
                   max_num_batched_tokens=16)
    _assert_close(_embeddings(llm, prompts, priority=[3, -2, 0]),
                  hf_pooled(matryoshka, prompts, "LAST", True))
    with pytest.raises(ValueError, match="3 prompts but 2 priorities"):
        llm.embed(prompts, priority=[1, 2], use_tqdm=False)
    fcfs = make_llm(matryoshka, runner="pooling")
    with pytest.raises(ValueError, match="priority=1 is only used with priority scheduling"):
        fcfs.embed(prompts, priority=[0, 1, 0], use_tqdm=False)
    _assert_all_blocks_free(fcfs)
    assert len(_embeddings(fcfs, prompts, priority=[0, 0, 0])) == 3
