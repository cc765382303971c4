"""What every device supplies to the device-agnostic engine.

A platform is a class with class attributes and classmethod hooks; the engine asks it for
kernels and memory facts and never checks which device it runs on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

import torch

from pagedserve.errors import ConfigError

if TYPE_CHECKING:
    from pagedserve.attention.backend import AttentionBackend
    from pagedserve.lora.ops import LoRAOps
    from pagedserve.models.forward_context import ForwardContext
    from pagedserve.models.layer_ops import LayerOps
    from pagedserve.quant.linear_method import LinearMethod, MatmulNumerics
    from pagedserve.quant.weights import LoadedWeight


class PlatformUnavailable(RuntimeError):
    """The requested device or its software stack is missing; the message is one line."""


class DeviceEvent(Protocol):
    """A point in the device's queue of work (``torch.cuda.Event`` and its kin)."""

    def synchronize(self) -> None: ...


class GraphRunner(Protocol):
    """Captures decode steps once and replays them (CUDA graphs and their kin).

    Built after the KV pool, for batches of up to ``max_num_seqs`` sequences and contexts of up
    to ``max_model_len`` tokens, and verify steps of up to ``verify_len`` tokens a sequence
    (speculative decoding; 1: none) where the runner can; the model runner replays a step only
    where ``can_run`` says so and runs the model eagerly otherwise.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 verify_len: int = 1) -> None: ...

    def capture(self) -> None: ...

    def can_run(self, ctx: ForwardContext) -> bool: ...

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor: ...


class ChainGraphRunner(Protocol):
    """Captures an EAGLE-3 head's greedy chained passes (drafts 2 .. k) in one graph per
    batch size and replays them (``worker/eagle_drafter.py`` drives it)."""

    def __init__(self, head: torch.nn.Module, kv_cache: torch.Tensor, dtype: torch.dtype,
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 num_passes: int) -> None: ...

    def capture(self) -> None: ...

    def can_run(self, num_rows: int, width: int) -> bool: ...

    def run(self, first: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
            num_drafts: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor: ...


class WeightStream:
    """Copies of offloaded weights (``--cpu-offload-gb``) from host memory into the device's
    staging slots, ordered against the model's compute (``models/offload.py`` drives it).

    The protocol, per slot: ``load`` queues a copy into it, which starts only once the compute
    queued before the slot's last ``release`` is done; ``wait`` makes the compute queued after
    it wait for the slot's last ``load``. ``begin``, at the start of each forward pass, orders
    every later copy after all compute queued so far, so a pass that failed halfway leaves no
    slot in use. This default runs each copy at once, in order (devices that run
    synchronously, and the CPU, whose "device" memory is host memory too), so ``wait``,
    ``release`` and ``begin`` have nothing to do.
    """

    # Host buffers are page-locked, so copies from them run asynchronously at the bus's rate.
    pin_memory: ClassVar[bool] = False

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Where one offloaded layer's bytes live (uint8)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    def begin(self) -> None:
        """A forward pass starts."""

    def load(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst <- src`` (``dst`` in slot ``slot``'s staging buffer)."""
        dst.copy_(src)

    def wait(self, slot: int) -> None:
        """Compute queued from now on reads slot ``slot`` as its last ``load`` left it."""

    def release(self, slot: int) -> None:
        """Compute queued so far is the last to read slot ``slot`` before its next ``load``."""

class BlockCopier:
    """Moves whole KV blocks between a device pool ``[layers, 2, blocks, block_size, heads,
    head_dim]`` and a host pool ``[blocks, layers, 2, block_size, heads, head_dim]``, where
    each block of all layers is one contiguous unit (one copy per block, and one file on disk).

    Contract: ``to_host``/``to_device`` queue the copies of one step's pairs, in call order,
    after the device work queued before them; ``wait_host`` returns once every queued copy has
    landed, so that the CPU may read or overwrite host blocks; ``wait_device`` makes work
    queued afterwards on the device see every copy (the forward pass reads loaded blocks).
    This default runs the copies on the device's queue and ``wait_host`` synchronizes the
    device; CUDA and ROCm run them on a stream of their own (``platforms/cuda``).
    """

    def __init__(self, platform: type[Platform]) -> None:
        self.platform = platform

    def to_host(self, pool: torch.Tensor, host: torch.Tensor, src: list[int],
                dst: list[int]) -> None:
        gathered = pool[:, :, torch.tensor(src, device=pool.device)].movedim(2, 0)
        host[torch.tensor(dst)] = gathered.to(host.device)

    def to_device(self, host: torch.Tensor, pool: torch.Tensor, src: list[int],
                  dst: list[int]) -> None:
        moved = host[torch.tensor(src)].to(pool.device, non_blocking=host.is_pinned())
        pool[:, :, torch.tensor(dst, device=pool.device)] = moved.movedim(0, 2)

    def wait_host(self) -> None:
        self.platform.synchronize()

    def wait_device(self) -> None:
        """Nothing to do: the copies ran on the device's own queue."""


class MemoryInfo(NamedTuple):
    free_bytes: int
    total_bytes: int


class Platform:
    name: ClassVar[str]
    device_type: ClassVar[str]
    # Swap space lives in page-locked host memory where copies to the device are async.
    pin_swap_memory: ClassVar[bool] = False
    # A dummy forward at the largest batch measures activation memory before the KV pool is
    # sized; platforms without a peak-memory counter size the pool from free memory instead.
    profiles_memory: ClassVar[bool] = False
    # The host queues device work and runs ahead of it, so scheduling the next step while
    # this one computes (async scheduling) hides the host's per-step work.
    runs_ahead: ClassVar[bool] = False
    # The device compiles a graph per distinct input shape (Gaudi), so the input packing pads
    # each step to a small set of bucketed shapes, which warm-up runs before the first request
    # (--shape-bucketing's default).
    buckets_shapes: ClassVar[bool] = False
    # --block-size when the command line leaves it out.
    default_block_size: ClassVar[int] = 16
    # torch.distributed backend for tensor parallelism between ranks on this device.
    dist_backend: ClassVar[str] = "gloo"
    # The Ray resource a tensor-parallel rank reserves on its node.
    ray_resource: ClassVar[str] = "CPU"
    # --enable-sleep-mode: the weights can leave the device and come back (the KV pool is
    # dropped and allocated again, the graphs captured again); release_cached_memory then
    # hands the freed memory back to the device.
    supports_sleep_mode: ClassVar[bool] = True
    # The environment variable that limits which of the host's devices a process sees
    # (CUDA_VISIBLE_DEVICES and its kin): data-parallel replicas are each given theirs through
    # it. None: every process shares the one device (the CPU).
    visible_devices_env: ClassVar[str | None] = None

    @classmethod
    def check_available(cls) -> None:
        """Raise ``PlatformUnavailable`` with a one-line reason if this device cannot be used."""
        raise NotImplementedError

    @classmethod
    def device_count(cls) -> int:
        """The devices this process sees: the accelerators where ``visible_devices_env`` picks
        them, else the host itself."""
        return 1

    @classmethod
    def visible_devices(cls, environ: Mapping[str, str]) -> list[str] | None:
        """The ids a process started with ``environ`` sees its devices by, as
        ``visible_devices_env`` lists them: its value split at commas, else ``0 ..
        device_count() - 1``; None where the platform has no such variable."""
        if cls.visible_devices_env is None:
            return None
        listed = environ.get(cls.visible_devices_env)
        if listed is None:
            return [str(i) for i in range(cls.device_count())]
        return [d.strip() for d in listed.split(",") if d.strip()]

    @classmethod
    def device(cls) -> torch.device:
        return torch.device(cls.device_type)

    @classmethod
    def bind_device(cls, index: int, ranks_on_host: int) -> None:
        """Make this process's ``device()`` the ``index``-th of its host's devices, for one of
        ``ranks_on_host`` tensor-parallel ranks there (called before any device work)."""

    @classmethod
    def default_dtype(cls) -> torch.dtype:
        return torch.bfloat16

    @classmethod
    def attention_backend(cls) -> type[AttentionBackend]:
        """Paged attention for this device; by default the portable torch implementation."""
        from pagedserve.attention.torch_paged import TorchPagedAttention

        return TorchPagedAttention

    @classmethod
    def layer_ops(cls) -> type[LayerOps]:
        """RMSNorm, SwiGLU and rotary embeddings for this device; by default plain torch."""
        from pagedserve.models.layer_ops import LayerOps

        return LayerOps

    @classmethod
    def linear_method(cls, weight: LoadedWeight,
                      numerics: MatmulNumerics | None = None) -> LinearMethod:
        """How a linear layer with this loaded weight (dense or quantized) is held and
        multiplied here; by default dequantized at load into a dense weight, so every format
        loads on every device. ``numerics``: where the method may trade accuracy for speed
        (``--int8-activations``, ``--fp8-fast-accumulation``); None: the defaults."""
        from pagedserve.quant.linear_method import DenseLinearMethod

        return DenseLinearMethod()

    @classmethod
    def lora_ops(cls) -> type[LoRAOps]:
        """The batched LoRA matmuls here; by default the portable torch implementation (a
        dense matmul against every slot, masked per row)."""
        from pagedserve.lora.ops import LoRAOps

        return LoRAOps

    @classmethod
    def kv_cache_torch_dtype(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        """The element type of the KV pool for ``--kv-cache-dtype``: the model's, which a
        dtype's name (``bfloat16``) may also ask for."""
        if kv_cache_dtype != "auto" and getattr(torch, kv_cache_dtype, None) != model_dtype:
            raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype} is not supported on the "
                              f"{cls.name} platform; use auto")
        return model_dtype

    @classmethod
    def memory_info(cls) -> MemoryInfo:
        raise NotImplementedError

    @classmethod
    def kv_cache_budget_bytes(cls, utilization: float, peak_used_bytes: int) -> int:
        """Bytes the KV pool may take once weights and activations (``peak_used_bytes``) sit."""
        info = cls.memory_info()
        return max(0, int(info.total_bytes * utilization) - peak_used_bytes)

    @classmethod
    def allocate_kv_cache(cls, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The KV pool. Backends never read a slot before writing it, except past a
        sequence's end where they mask, so the pool needs no zeroing (which costs seconds
        of page faults for a large host pool)."""
        return torch.empty(shape, dtype=dtype, device=cls.device())

    @classmethod
    def copy_blocks(cls, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks within one pool (all layers, keys and values): dst[i] <- src[i].

        ``kv_cache`` is ``[num_layers, 2, num_blocks, ...]``; ``src``/``dst`` are int64 block
        ids on the cache's device. Used for copy-on-write.
        """
        kv_cache[:, :, dst] = kv_cache[:, :, src]

    @classmethod
    def block_copier(cls) -> BlockCopier:
        """Moves whole blocks between the device pool and the host pool (swap and the
        offloading tier); by default on the device's own queue (``BlockCopier``)."""
        return BlockCopier(cls)

    @classmethod
    def reset_peak_memory(cls) -> None:
        """Start a new peak-memory measurement (only where ``profiles_memory``)."""

    @classmethod
    def peak_memory_bytes(cls) -> int:
        return 0

    @classmethod
    def graph_runner(cls) -> type[GraphRunner] | None:
        """A class that captures and replays decode steps, or None where graphs don't exist."""
        return None

    @classmethod
    def chain_graphs(cls) -> type[ChainGraphRunner] | None:
        """A class that captures an EAGLE-3 head's chained drafting passes in one graph per
        batch size (``platforms/cuda/chain_graphs.py``), or None: they run eagerly."""
        return None

    @classmethod
    def weight_stream(cls, num_slots: int) -> WeightStream:
        """The copies that bring offloaded layers (``--cpu-offload-gb``) into ``num_slots``
        staging slots; by default synchronous ``copy_`` calls."""
        return WeightStream(num_slots)

    @classmethod
    def release_cached_memory(cls) -> None:
        """Hand memory freed by Python back to the device (allocator caches)."""

    @classmethod
    def record_event(cls) -> DeviceEvent | None:
        """Mark the work queued so far, or None where the device runs synchronously."""
        return None

    @classmethod
    def synchronize(cls) -> None:
        """Wait for queued device work; a no-op where execution is synchronous."""

    @classmethod
    def end_forward(cls) -> None:
        """Called once after every model forward: where the device runs lazily (Gaudi), this
        closes the graph of the forward's ops so it compiles and runs on its own, apart from
        the sampler's. Nothing elsewhere."""

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        torch.manual_seed(seed)
