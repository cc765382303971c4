"""CPU weight offload (``--cpu-offload-gb``, models/offload.py) on the CPU platform, whose
"device" is host memory too: the layers are copied by the platform's copy path into staging
buffers of their own, so the mechanism runs as it does on a GPU. The reference is the same
checkpoint fully resident: greedy tokens and logprobs must be identical."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.errors import ConfigError
from pagedserve.platforms.interface import WeightStream
from tests.quant.fp8_ct_checkpoints import write_block_fp8
from tests.quant.packers import write_quantized_pair
from tests.tiny_models import make_llm, random_prompts, write_tiny_model

NUM_LAYERS = 5
PROMPT_LENS = (3, 17, 40)


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    """A 5-layer Llama-3-shaped checkpoint: offloading 3 layers reuses a slot."""
    return write_tiny_model(tmp_path_factory.mktemp("offload") / "llama5", "llama3",
                            num_hidden_layers=NUM_LAYERS)


def engine(folder, **kwargs):
    """Without prefix caching, so running the same prompts again computes them the same way
    (a cache hit changes the rounding of the logprobs)."""
    return make_llm(folder, dtype="float32", enable_prefix_caching=False, **kwargs)


def layer_param_bytes(llm, index: int = 0) -> int:
    layer = llm.engine.executor.runner.model.model.layers[index]
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def gib_for_layers(resident_llm, count: float) -> float:
    """A --cpu-offload-gb that offloads ceil(count) layers."""
    return count * layer_param_bytes(resident_llm) / 2**30


def greedy(llm, prompts):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


def assert_runs_from_the_host_copy(llm, prompts, before) -> None:
    """Zeroing the host copy of the last layer's down projection (whatever tensors its linear
    method holds) changes the outputs: it runs from that copy, not from a tensor kept on the
    side (a quant method's own reference to its packed weight, say)."""
    runner = llm.engine.executor.runner
    down = list(runner.model.model.layers[-1].mlp.down_proj.parameters())
    host = runner.offload._host[NUM_LAYERS - 1]
    for placed in host.placed:
        if any(placed.tensor is t for t in down):
            placed.view(host.host).zero_()
    assert greedy(llm, prompts) != before


@pytest.fixture(scope="module")
def resident(five_layers):
    return engine(five_layers)


@pytest.mark.parametrize("layers,chosen", [(2.5, range(2, 5)), (100, range(0, 5))])
def test_greedy_tokens_and_logprobs_equal_the_resident_model(five_layers, resident, layers,
                                                             chosen):
    llm = engine(five_layers, cpu_offload_gb=gib_for_layers(resident, layers))
    assert llm.engine.executor.runner.offload.chosen == chosen
    prompts = random_prompts(f"offload{layers}", PROMPT_LENS)
    outputs = greedy(resident, prompts)
    assert greedy(llm, prompts) == outputs
    assert_runs_from_the_host_copy(llm, prompts, outputs)


def test_qwen2_biases_and_a_tied_head_offload_too(tiny_model_folder):
    """Qwen2's q/k/v biases leave with their layers; the tied LM head (the embedding's table)
    stays resident."""
    folder = tiny_model_folder("qwen2")
    base = engine(folder)
    llm = engine(folder, cpu_offload_gb=1.0)
    runner = llm.engine.executor.runner
    assert runner.offload.chosen == range(0, 2)
    assert runner.offload.holds(runner.model.model.layers[1].self_attn.qkv_proj.bias)
    assert not runner.offload.holds(runner.model.lm_head.weight)
    prompts = random_prompts("offload-qwen2", PROMPT_LENS)
    assert greedy(llm, prompts) == greedy(base, prompts)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "block-fp8"])
def test_mixtral_experts_offload_with_their_layers(tiny_model_folder, tmp_path, quantized):
    """A layer's stacked experts (made from Mixtral's ``block_sparse_moe`` tensors, counted
    under the checkpoint's names), float or kept quantized, leave with it; the router too."""
    folder = tiny_model_folder("mixtral")
    if quantized:
        folder = write_block_fp8(folder, tmp_path, (32, 32)).quantized
    base = engine(folder)
    llm = engine(folder, cpu_offload_gb=1.0)
    runner = llm.engine.executor.runner
    assert runner.offload.chosen == range(0, 2)
    block = runner.model.model.layers[1].mlp
    experts = block.experts.quantized.down.values if quantized else block.experts.w13
    assert runner.offload.holds(experts) and runner.offload.holds(block.gate.weight)
    prompts = random_prompts("offload-mixtral", PROMPT_LENS)
    assert greedy(llm, prompts) == greedy(base, prompts)


def test_offloaded_layers_are_views_into_the_staging_slots(five_layers, resident):
    llm = engine(five_layers, cpu_offload_gb=gib_for_layers(resident, 2.5))
    runner = llm.engine.executor.runner
    offload, layers = runner.offload, runner.model.model.layers
    slots = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in offload.slots]
    assert len(slots) == 2

    def slot_of(p: torch.Tensor) -> int | None:
        return next((i for i, (lo, hi) in enumerate(slots) if lo <= p.data_ptr() < hi), None)

    for index, layer in enumerate(layers):
        expected = {2: 0, 3: 1, 4: 0}.get(index)  # o_k in slot k % 2
        assert {slot_of(p) for p in layer.parameters()} == {expected}, index
    # The offloaded bytes left the device: what is resident is the rest plus two slots.
    per_layer = layer_param_bytes(resident)
    assert runner.weight_bytes() == resident.engine.executor.runner.weight_bytes()
    assert runner.resident_weight_bytes() == (runner.weight_bytes() - 3 * per_layer
                                              + offload.staging_bytes)
    # Each slot holds one layer, its tensors 256-byte aligned: under a few KiB of padding.
    assert per_layer <= offload.staging_bytes / 2 < per_layer + 16 * 256
    assert offload.host_bytes == 3 * offload.staging_bytes // 2


class RecordingStream(WeightStream):
    """The CPU's copies, with every call of the protocol recorded."""

    calls: list[tuple] = []

    def begin(self):
        self.calls.append(("begin",))

    def load(self, slot, dst, src):
        self.calls.append(("load", slot, src.data_ptr()))
        super().load(slot, dst, src)

    def wait(self, slot):
        self.calls.append(("wait", slot))

    def release(self, slot):
        self.calls.append(("release", slot))


def test_each_pass_prefetches_the_next_layer_while_one_runs(five_layers, resident, monkeypatch):
    """Offloaded layers 2, 3, 4 in slots 0, 1, 0: both slots are loaded before the first
    decoder layer, and layer 4 goes into slot 0 only once layer 2 has released it."""
    from pagedserve.platforms.cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "weight_stream", classmethod(
        lambda cls, n: RecordingStream(n)))
    llm = engine(five_layers, cpu_offload_gb=gib_for_layers(resident, 2.5))
    offload = llm.engine.executor.runner.offload
    hosts = [offload._host[i].host.data_ptr() for i in offload.chosen]
    RecordingStream.calls.clear()
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert RecordingStream.calls == [
        ("begin",), ("load", 0, hosts[0]), ("load", 1, hosts[1]),
        ("wait", 0), ("release", 0), ("load", 0, hosts[2]),
        ("wait", 1), ("release", 1),
        ("wait", 0), ("release", 0)]


@pytest.fixture(scope="module")
def gptq_five_layers(five_layers, tmp_path_factory):
    root = tmp_path_factory.mktemp("offload-gptq")
    write_quantized_pair(five_layers, root / "gptq", root / "float", dict(
        quant_method="gptq", bits=4, group_size=32, sym=True, desc_act=True))
    return root / "gptq"


def test_a_gptq_model_offloaded_equals_it_resident(gptq_five_layers, cpu_quant_kernel):
    """The quant method's packed tensors (qweight, scales, ...) are what is offloaded."""
    base = engine(gptq_five_layers)
    llm = engine(gptq_five_layers, cpu_offload_gb=gib_for_layers(base, 2.5))
    layer = llm.engine.executor.runner.model.model.layers[4]
    assert type(layer.mlp.down_proj.method).__name__ == cpu_quant_kernel
    assert llm.engine.executor.runner.offload.chosen == range(2, 5)
    prompts = random_prompts("offload-gptq", PROMPT_LENS)
    outputs = greedy(base, prompts)
    assert greedy(llm, prompts) == outputs
    assert_runs_from_the_host_copy(llm, prompts, outputs)


def test_a_negative_size_names_the_flag(five_layers):
    with pytest.raises(ConfigError, match="--cpu-offload-gb"):
        make_llm(five_layers, cpu_offload_gb=-1)


def test_each_layer_leaves_the_device_as_soon_as_it_is_loaded(five_layers, resident,
                                                              monkeypatch):
    """Layers are offloaded while the checkpoint streams in, each once its last tensor is in
    place, not after the whole model was loaded: when loading ends (``finish``), every chosen
    layer already has its bytes in host memory and its device tensors emptied."""
    from pagedserve.models.offload import LayerOffload

    seen = []
    finish = LayerOffload.finish

    def record(self):
        layers = self.layers
        seen.append((sorted(self._host), [p.numel() for i in self.chosen
                                          for p in layers[i].parameters()]))
        finish(self)

    monkeypatch.setattr(LayerOffload, "finish", record)
    engine(five_layers, cpu_offload_gb=gib_for_layers(resident, 2.5))
    [(offloaded, sizes)] = seen
    assert offloaded == [2, 3, 4] and set(sizes) == {0}


@pytest.mark.slow
def test_two_tensor_parallel_ranks_offload_their_own_slices(five_layers, resident):
    """Each rank offloads its slice of the same layers; the tokens are one resident rank's
    (as tensor parallelism's own tests compare)."""
    prompts = random_prompts("offload-tp", PROMPT_LENS)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in resident.generate(prompts, params,
                                                                  use_tqdm=False)]
    llm = engine(five_layers, tensor_parallel_size=2,
                 cpu_offload_gb=gib_for_layers(resident, 1.5) / 2)
    try:
        assert llm.engine.executor.runner.offload.chosen == range(3, 5)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                             use_tqdm=False)] == expected
    finally:
        llm.engine.shutdown()


def test_the_default_models_gguf_blocks_offload(default_model_folder):
    """A real checkpoint: SmolLM2-135M's Q8_0 and Q4 GGUF blocks, 30 layers, 21 offloaded
    (0.05 GiB), on the CPU's quantized kernels; tokens and logprobs equal it resident."""
    base = engine(default_model_folder)
    llm = engine(default_model_folder, cpu_offload_gb=0.05)
    runner = llm.engine.executor.runner
    assert runner.offload.chosen == range(9, 30)
    down = runner.model.model.layers[29].mlp.down_proj
    assert type(down.method).__name__ in ("NativeQuantLinearMethod", "Int4PackLinearMethod")
    assert runner.resident_weight_bytes() < 0.7 * runner.weight_bytes()
    prompts = random_prompts("offload-default", PROMPT_LENS)
    assert greedy(llm, prompts) == greedy(base, prompts)


def test_the_kv_pool_gets_the_bytes_the_offload_frees(five_layers, resident):
    """Sized the base platform's way (a share of the device minus the weights), the pool
    counts only resident weights and the staging slots: offloading 3 layers into 2 slots
    frees one layer's bytes for KV blocks."""
    import dataclasses

    from pagedserve.platforms.cpu.platform import CpuPlatform
    from pagedserve.platforms.interface import MemoryInfo, Platform
    from pagedserve.worker.cache_sizing import size_kv_cache

    class SizedLikeADevice(CpuPlatform):
        profiles_memory = False  # the weights are what is used: ``resident_weight_bytes``
        kv_cache_budget_bytes = classmethod(Platform.kv_cache_budget_bytes.__func__)

        @classmethod
        def memory_info(cls):
            return MemoryInfo(16 << 20, 16 << 20)

    offloaded = engine(five_layers, cpu_offload_gb=gib_for_layers(resident, 2.5))
    blocks = {}
    for name, llm in (("resident", resident), ("offloaded", offloaded)):
        e = llm.engine
        config = dataclasses.replace(e.config, kv_cache_memory_bytes=None)
        sizes = size_kv_cache(config, e.resolved, SizedLikeADevice, e.executor.runner)
        blocks[name], per_block = sizes.num_blocks, sizes.bytes_per_block
    runner = offloaded.engine.executor.runner
    freed = runner.weight_bytes() - runner.resident_weight_bytes()
    assert freed > 0.9 * layer_param_bytes(resident)
    assert blocks["offloaded"] - blocks["resident"] in (freed // per_block,
                                                        freed // per_block + 1)


def test_no_graphs_are_captured_while_offloading(five_layers, resident, monkeypatch):
    """A platform with a graph runner runs eagerly when layers are offloaded (replay would skip
    the copies); random (``dummy``) weights stream in like a checkpoint's."""
    from tests.graph_stubs import record_graphs

    built = record_graphs(monkeypatch)
    llm = engine(five_layers, load_format="dummy",
                 cpu_offload_gb=gib_for_layers(resident, 2.5))
    assert llm.engine.executor.runner.offload.chosen == range(2, 5)
    assert built == [] and llm.engine.executor.runner.graphs is None
    engine(five_layers, load_format="dummy", enforce_eager=False)
    assert len(built) == 1  # the fake runner is asked for, without offload


def test_dummy_weights_hold_the_resident_layers_and_one_more_at_most(five_layers, resident,
                                                                     monkeypatch):
    """``--load-format dummy`` with offload, the way the 70B row runs on one H200 (131 GiB of
    weights, 139 GiB of device memory, 128 GiB of host memory): each random tensor is made on
    the device as the loader asks for it and an offloaded layer leaves as soon as it is
    complete, so at no point do the generated tensors still alive exceed the resident weights
    plus the one layer being read; the host buffers are the offloaded layers' bytes alone, so
    nothing resident is staged through host memory."""
    import weakref

    from pagedserve.platforms.cpu.platform import CpuPlatform
    from pagedserve.worker.model_runner import ModelRunner

    made, host, peak = [], [], [0]
    real_load = ModelRunner.load_weights

    def held(model) -> int:
        """Bytes of the model's parameters and of the generated tensors still alive (q/k/v
        shards waiting for their fused layer), each storage once."""
        tensors = [*model.parameters(), *(t for t in (r() for r in made) if t is not None)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors}
        return sum(storages.values())

    def load_weights(self, weights):
        def watched():
            for name, tensor in weights:
                assert tensor.device == self.device
                made.append(weakref.ref(tensor))
                peak[0] = max(peak[0], held(self.model))
                yield name, tensor

        real_load(self, watched())

    class CountingStream(WeightStream):
        def host_buffer(self, nbytes):
            host.append(nbytes)
            return super().host_buffer(nbytes)

    monkeypatch.setattr(ModelRunner, "load_weights", load_weights)
    monkeypatch.setattr(CpuPlatform, "weight_stream", classmethod(
        lambda cls, n: CountingStream(n)))
    llm = engine(five_layers, load_format="dummy",
                 cpu_offload_gb=gib_for_layers(resident, 2.5))
    offload = llm.engine.executor.runner.offload
    assert offload.chosen == range(2, 5)
    per_layer = layer_param_bytes(resident)
    total = resident.engine.executor.runner.weight_bytes()
    largest = 4 * max(math.prod(shape) for shape in
                      llm.engine.executor.runner.model.checkpoint_shapes().values())
    # Three layers offloaded: the whole model (what loading everything first would hold) is
    # three layers more than the resident part. The bound allows the layer being read and
    # the tensor loaded before the one asked for (the model's loop still holds it).
    assert total - 3 * per_layer < peak[0] <= total - 2 * per_layer + largest < total
    assert len(host) == 3 and sum(host) == offload.host_bytes < 3 * per_layer + 3 * 16 * 256
