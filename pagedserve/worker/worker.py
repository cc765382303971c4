"""One rank: its device, its slice of the model (its tensor-parallel share of its pipeline
stage's layers), its KV pool (of those layers).

Every rank builds the same way, in the same order, because the steps that follow are
collectives: the process group, the weights (each rank keeps its slice), the memory profile
(a forward pass), and the KV pool, whose block count is the smallest any rank can hold so that
the driver's block ids are valid on every rank.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from pagedserve import distributed, envs
from pagedserve.config import EngineConfig, ResolvedConfig
from pagedserve.distributed import Layout, Rendezvous, TensorParallel, split_heads
from pagedserve.errors import ConfigError
from pagedserve.logger import get_logger
from pagedserve.models import loader
from pagedserve.models.config import ModelArchConfig
from pagedserve.models.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    iter_head_weights,
    random_head_weights,
)
from pagedserve.models.linear import LinearFactory
from pagedserve.platforms import resolve_platform
from pagedserve.platforms.interface import Platform
from pagedserve.quant.formats import checkpoint_format, load_quantizer
from pagedserve.spec_decode.config import DEVICE_METHODS
from pagedserve.user_paths import expand_user
from pagedserve.worker.cache_sizing import CacheSizes, size_kv_cache
from pagedserve.worker.disk_tier import DiskTier, model_identity
from pagedserve.worker.drafter import Drafter
from pagedserve.worker.eagle_drafter import EagleDrafter
from pagedserve.worker.kv_cache import KVCacheSpec
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.pooler import Pooler
from pagedserve.worker.shape_buckets import ShapeBuckets
from pagedserve.worker.warm_up import warm_up

logger = get_logger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to start: plain data, sent to its process or actor."""

    config: EngineConfig
    rank: int
    dist_address: str  # host:port of the driver's rendezvous store
    device_index: int  # among the devices this process sees
    ranks_on_host: int
    layer_split: tuple[int, ...]  # each pipeline stage's decoder layers (EngineConfig's)


class Worker:
    def __init__(self, spec: WorkerSpec, rendezvous: Rendezvous | None = None) -> None:
        """``rendezvous``: the driver's store and its way to learn that another rank died
        before joining (they stay in the driver's process; the spec is sent to the other
        ranks)."""
        config = spec.config
        start = time.perf_counter()
        self.platform = resolve_platform(config.device)
        self.layout = Layout(config.tensor_parallel_size, config.pipeline_parallel_size)
        self.is_driver = spec.rank == self.layout.driver
        if self.layout.size > 1:
            self.platform.bind_device(spec.device_index, spec.ranks_on_host)
            distributed.init(self.platform.dist_backend, spec.dist_address, spec.rank,
                             self.layout.size, envs.dist_timeout_s(), rendezvous)
        self.tp = self.layout.tensor_parallel(spec.rank)
        stage = self.layout.stage(spec.rank, spec.layer_split)
        self.platform.seed_everything(config.seed)
        dummy = config.load_format == "dummy"
        source = loader.resolve_model(config.model, not dummy, revision=config.revision,
                                      gguf_file=config.gguf_file)
        arch = loader.load_arch_config(source, config.hf_overrides)
        resolved = config.resolve(arch, self.platform)
        # Checked before any weight is read, so a bad quantization_config fails at once.
        fmt = None if dummy else checkpoint_format(arch.raw, config.quantization, source.gguf)
        self.runner = ModelRunner(self.platform, arch, resolved.dtype, resolved.max_model_len,
                                  config.kv_cache_dtype,
                                  load_quantizer(arch.raw, config.quantization, dummy),
                                  _shape_buckets(config, resolved), self.tp,
                                  int(config.cpu_offload_gb * 2**30), config.matmul_numerics(),
                                  [cls(config, self.platform.device())
                                   for cls in config.logits_processors],
                                  lm_head=config.pooling is None, stage=stage)
        if dummy:
            self.runner.init_dummy_weights(config.seed)
        else:
            self.runner.load_weights(fmt.read(loader.iter_weights(source)))
            self.runner.checkpoint_format = fmt  # LLM.load_weights reads its tensors alike
        if config.enable_lora:
            self.runner.add_lora(config.max_loras, config.max_lora_rank)
        if config.pooling is not None and self.is_driver:  # only the driver pools
            self.runner.pooler = Pooler(config.pooling, self.runner.device,
                                        self.runner.model.score, arch.classifier_activation)
        drafts = config.speculative_config
        # An EAGLE-3 head on the driver reads the target's embedding table: under tensor
        # parallelism a gathered copy (the target's own lookup is a collective).
        table = (self.runner.model.get_input_embeddings().gathered_to_first()
                 if drafts is not None and drafts.method == "eagle3" and self.tp.size > 1
                 else None)
        if drafts is not None and drafts.method in DEVICE_METHODS and self.is_driver:
            self.runner.add_drafter(
                _eagle_drafter(config, resolved, arch, self.platform, table)
                if drafts.method == "eagle3" else
                Drafter(_draft_runner(config, resolved, arch, self.platform),
                        resolved.max_num_batched_tokens))
        self.sizes = self._agree(size_kv_cache(config, resolved, self.platform, self.runner))
        self.runner.allocate_kv_cache(
            KVCacheSpec(self.sizes.num_blocks, resolved.block_size, self.runner.kv_dtype))
        if config.kv_offloading_disk is not None:
            self.runner.kv_cache.disk = self._disk_tier(config, resolved, source)
        # Graphs replay decode steps, which a pooling engine (prefill alone) never runs.
        if not config.enforce_eager and config.pooling is None:
            self.runner.capture_graphs(
                config.max_num_seqs, 1 + drafts.num_speculative_tokens if drafts else 1)
            if self.runner.drafter is not None:
                self.runner.drafter.capture_graphs(config.max_num_seqs)
        # After graph capture: HPU graphs record each bucket at its first run. Every rank
        # warms up the same shapes in the same order (the forwards hold collectives).
        warm_up(self.runner)
        if self.layout.size > 1:
            logger.info("%s of %d ready in %.1fs", self.layout.name(spec.rank),
                        self.layout.size, time.perf_counter() - start)

    def _disk_tier(self, config: EngineConfig, resolved: ResolvedConfig,
                   source: loader.ModelSource) -> DiskTier:
        kv = self.runner.kv_cache
        identity = model_identity(
            source.path, config.revision, config.seed if config.load_format == "dummy" else None,
            str(resolved.dtype), str(kv.pool.dtype), resolved.block_size, self.tp.rank,
            self.tp.size, kv.host_block_shape(),
            dict(quantization=config.quantization, platform=self.platform.name,
                 **dataclasses.asdict(config.matmul_numerics())))
        try:
            return DiskTier(expand_user(config.kv_offloading_disk), identity)
        except OSError as exc:
            raise ConfigError(f"--kv-offloading-disk {config.kv_offloading_disk!s}: cannot "
                              f"make its folder: {exc.strerror or exc}") from exc

    def leave(self, peers_alive: bool = True) -> None:
        """Leave the process group, after the graphs that hold its communicator."""
        self.runner.release_graphs()
        distributed.shutdown(peers_alive)

    def _agree(self, sizes: CacheSizes) -> CacheSizes:
        """The smallest pools over every rank: stages of more layers hold fewer blocks."""
        if self.layout.size == 1:
            return sizes
        blocks, host_blocks, offload_blocks = self.layout.min_over_ranks(
            [sizes.num_blocks, sizes.num_host_blocks, sizes.num_offload_blocks],
            self.runner.device)
        return CacheSizes(blocks, host_blocks, sizes.bytes_per_block, offload_blocks,
                          sizes.num_disk_blocks)


def _draft_runner(config: EngineConfig, resolved: ResolvedConfig, arch: ModelArchConfig,
                  platform: type[Platform]) -> ModelRunner:
    """The draft model of ``speculative_config``, on the driver's device, in the target's dtype
    and KV cache dtype; read like the target (any format the loader reads), or random with
    ``--load-format dummy`` (its config still read, for its shapes)."""
    dummy = config.load_format == "dummy"
    source = loader.resolve_model(config.speculative_config.model, not dummy)
    draft_arch = loader.load_arch_config(source)
    if not draft_arch.lm_head:
        raise ConfigError(f"--speculative-config: the draft model is a bare "
                          f"{draft_arch.checkpoint_architecture}, without an LM head: it "
                          "cannot draft tokens")
    if draft_arch.vocab_size != arch.vocab_size:
        raise ConfigError(
            f"--speculative-config: the draft model's vocabulary ({draft_arch.vocab_size} "
            f"tokens) differs from the target's ({arch.vocab_size})")
    runner = ModelRunner(platform, draft_arch, resolved.dtype, resolved.max_model_len,
                         config.kv_cache_dtype, load_quantizer(draft_arch.raw, "auto", dummy),
                         numerics=config.matmul_numerics())
    if dummy:
        runner.init_dummy_weights(config.seed + 1)
    else:
        fmt = checkpoint_format(draft_arch.raw, "auto", source.gguf)
        runner.load_weights(fmt.read(loader.iter_weights(source)))
    return runner


def _eagle_drafter(config: EngineConfig, resolved: ResolvedConfig, arch: ModelArchConfig,
                   platform: type[Platform], table: torch.Tensor | None) -> EagleDrafter:
    """The EAGLE-3 head of ``speculative_config``, on the driver's device in the target's dtype:
    read from its folder (safetensors or the public heads' ``pytorch_model.bin``; a hub id
    as any model, safetensors only), or random of its config's shapes with
    ``--load-format dummy``. Without a table of its own it shares the target's, or takes
    ``table`` (the target's, gathered) as its own."""
    dummy = config.load_format == "dummy"
    model = config.speculative_config.model
    local = expand_user(model).is_dir()
    source = loader.resolve_model(model, not dummy and not local)
    cfg = Eagle3Config.from_folder(source.path, arch)
    weights = {} if dummy else dict(iter_head_weights(source.path))
    if table is not None and "embed_tokens.weight" not in weights:
        weights["embed_tokens.weight"] = table
    own_embedding = "embed_tokens.weight" in weights
    if not own_embedding and cfg.arch.hidden_size != arch.hidden_size:
        raise ConfigError("--speculative-config: the EAGLE-3 head has no embedding table and "
                          f"its hidden size ({cfg.arch.hidden_size}) differs from the "
                          f"target's ({arch.hidden_size}), whose table it would read")
    device = platform.device()
    heads = split_heads(cfg.arch.num_heads, cfg.arch.num_kv_heads, TensorParallel())
    backend = platform.attention_backend()(
        heads.num_heads, cfg.arch.head_dim, heads.num_kv_heads, cfg.arch.head_dim ** -0.5,
        kv_cache_dtype=config.kv_cache_dtype)
    linears = LinearFactory(platform, resolved.dtype, device,
                            numerics=config.matmul_numerics())
    with torch.device(device):
        head = Eagle3Head(cfg, backend, resolved.max_model_len, platform.layer_ops(), linears,
                          own_embedding)
    head = head.to(dtype=resolved.dtype).eval()
    head.load_weights([*random_head_weights(head, config.seed + 1, resolved.dtype, device,
                                            skip=set(weights)), *weights.items()]
                      if dummy else weights.items())
    return EagleDrafter(head, platform, heads.num_kv_heads, device, resolved.dtype,
                        resolved.max_model_len,
                        config.speculative_config.num_speculative_tokens)


def _shape_buckets(config: EngineConfig, resolved: ResolvedConfig) -> ShapeBuckets | None:
    if not resolved.shape_bucketing:
        return None
    return ShapeBuckets.for_limits(config.max_num_seqs, resolved.max_num_batched_tokens,
                                   -(-resolved.max_model_len // resolved.block_size))
