"""The whole engine on the Triton kernels (attention and fused layer ops), on the CPU under
Triton's interpreter: greedy tokens equal the portable torch ops', with chunked prefill reading
context back from the cache.

Runs in a fresh process because the interpreter must be chosen before triton is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import sys
    from pagedserve import LLM, SamplingParams
    from pagedserve.platforms.cpu.platform import CpuPlatform
    from pagedserve.platforms.cuda.attention import TritonAttentionBackend
    from pagedserve.platforms.cuda.layer_ops import TritonLayerOps

    folder = sys.argv[1]
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61)), [300, 3]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run():
        llm = LLM(model=folder, device="cpu", kv_cache_memory_bytes=1 << 20, block_size=16,
                  max_num_batched_tokens=16)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = run()
    CpuPlatform.attention_backend = classmethod(lambda cls: TritonAttentionBackend)
    CpuPlatform.layer_ops = classmethod(lambda cls: TritonLayerOps)
    got = run()
    print(reference, got)
    sys.exit(0 if got == reference else 1)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="covered by the cuda engine tests")
def test_engine_on_triton_interpreter_matches_torch_backend(tmp_path):
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "qwen2", "qwen2")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
