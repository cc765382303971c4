"""The model runner's start-up measurements."""

from __future__ import annotations

import pytest

from pagedserve import SamplingParams
from pagedserve.worker.warm_up import profile_peak_memory
from tests.graph_stubs import record_graphs
from tests.tiny_models import ARCH_CONFIGS, make_llm


def test_memory_profile_splits_a_budget_longer_than_the_context(llama3_folder):
    """A token budget above max_model_len is profiled as several prompts: one prompt that long
    would index positions past the rotary table."""
    runner = make_llm(llama3_folder, kv_cache_memory_bytes=1 << 20,
                      max_model_len=64).engine.executor.runner
    assert profile_peak_memory(runner, num_tokens=3 * 64 + 5, max_num_seqs=4,
                               block_size=16) >= 0
    assert runner.kv_cache is None


def test_decode_weight_bytes_leave_out_an_untied_embedding_table(tiny_model_folder):
    """The decode roofline counts the bytes a step reads: an untied input embedding is read one
    row at a time, a tied one is read whole as the LM head."""
    for arch, tied in (("llama3", False), ("qwen2", True)):
        llm = make_llm(tiny_model_folder(arch), kv_cache_memory_bytes=1 << 20)
        runner = llm.engine.executor.runner
        table = runner.model.get_input_embeddings().weight
        skipped = 0 if tied else table.numel() * table.element_size()
        assert runner.weight_bytes_read_per_token_step() == runner.weight_bytes() - skipped > 0



def test_decode_weight_bytes_count_the_experts_a_batch_touches(tiny_model_folder):
    """Of a mixture of experts a decode step reads the experts its tokens are routed to: with
    uniform routing each of E experts is missed by a token with probability (E - k) / E, so
    a batch of b leaves E * ((E - k) / E) ** b of them unread per layer. The expert bytes are
    counted from the config, not from the module."""
    cfg = ARCH_CONFIGS["mixtral"]
    llm = make_llm(tiny_model_folder("mixtral"), kv_cache_memory_bytes=1 << 20)
    runner = llm.engine.executor.runner
    table = runner.model.get_input_embeddings().weight
    dense = runner.weight_bytes() - table.numel() * table.element_size()
    experts, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    expert_bytes = (cfg["num_hidden_layers"] * experts * 3 * cfg["hidden_size"]
                    * cfg["intermediate_size"] * table.element_size())
    for batch in (1, 3, 1000):
        unread = expert_bytes * ((experts - k) / experts) ** batch
        assert runner.weight_bytes_read_per_token_step(batch) == round(dense - unread)
    assert runner.weight_bytes_read_per_token_step(1) < dense * 0.75

def test_memory_profile_runs_a_mixed_step_and_a_prompt_step(llama3_folder, monkeypatch):
    """Both forms a step's attention can take (one-row sequences beside prompt chunks, and
    prompts alone) run at start-up, so their kernels compile there and not in a served step."""
    runner = make_llm(llama3_folder, kv_cache_memory_bytes=1 << 20,
                      max_model_len=64).engine.executor.runner
    forms = []
    run_model = runner.run_model

    def spy(inputs):
        forms.append(inputs.ctx.attn.query_lens_cpu)
        return run_model(inputs)

    monkeypatch.setattr(runner, "run_model", spy)
    profile_peak_memory(runner, num_tokens=100, max_num_seqs=4, block_size=16)
    assert forms == [[64, 35, 1], [2]]


@pytest.mark.parametrize("arch,captured", [("llama3", True), ("mixtral", False)])
def test_moe_models_capture_no_graphs_while_their_experts_op_syncs(tiny_model_folder,
                                                                   monkeypatch, arch, captured):
    """The portable ``fused_moe`` reads its per-expert counts on the host, which a graph
    capture forbids: a platform with graphs runs MoE decode steps eagerly instead."""
    runner = make_llm(tiny_model_folder(arch), kv_cache_memory_bytes=1 << 20
                      ).engine.executor.runner
    made = record_graphs(monkeypatch, runner.platform)
    runner.capture_graphs(max_num_seqs=4)
    assert bool(made) == captured
    runner.graphs = None


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_dummy_weights_load_every_tensor_and_generate(tiny_model_folder, arch):
    """``--load-format dummy``: random weights of each architecture's shapes (Qwen3's q/k
    norms included: a tensor left out would fail the load's completeness check)."""
    llm = make_llm(tiny_model_folder(arch), load_format="dummy", kv_cache_memory_bytes=1 << 20)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.generate([[5, 6, 7], list(range(3, 40))], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
