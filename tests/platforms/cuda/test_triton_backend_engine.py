"""The whole engine on the Triton kernels (attention, fused layer ops and experts), on the CPU under
Triton's interpreter: greedy tokens equal the portable torch ops', with chunked prefill reading
context back from the cache.

The interpreter must be chosen before triton is imported (tests/conftest.py does that); if
something imported triton earlier, the test runs in a fresh process instead.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.devices import HAS_NVIDIA, choose_triton_interpreter

IMPORTED_TOO_LATE = choose_triton_interpreter()
pytest.importorskip("triton")

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.platforms.cpu.platform import CpuPlatform  # noqa: E402
from tests.tiny_models import make_llm  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61)), [300, 3]]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _greedy(folder) -> list[list[int]]:
    llm = make_llm(folder, kv_cache_memory_bytes=1 << 20, block_size=16,
                   max_num_batched_tokens=16)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.skipif(HAS_NVIDIA, reason="covered by the cuda engine tests")
# qwen3: q/k norms on the Triton RMSNorm; phi3: the rotary kernel on the first 0.75 of each
# head; granite: its softmax scale (0.4, not 1/sqrt(16)) through both attention kernels;
# mixtral: the experts through the fused MoE kernel's grouped GEMMs; gemma2, gemma3: windows
# of 8 (a 41-token prompt in chunks of 16) and gemma2's score caps through both kernels.
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3", "granite", "mixtral", "gemma2",
                                  "gemma3"])
def test_engine_on_triton_interpreter_matches_torch_backend(tiny_model_folder, monkeypatch,
                                                            arch):
    if IMPORTED_TOO_LATE:
        _run_in_a_fresh_interpreter_process()
        return
    from pagedserve.platforms.cuda.attention import TritonAttentionBackend
    from pagedserve.platforms.cuda.layer_ops import TritonLayerOps

    folder = tiny_model_folder(arch)
    reference = _greedy(folder)
    monkeypatch.setattr(CpuPlatform, "attention_backend",
                        classmethod(lambda cls: TritonAttentionBackend))
    monkeypatch.setattr(CpuPlatform, "layer_ops", classmethod(lambda cls: TritonLayerOps))
    assert _greedy(folder) == reference


def _run_in_a_fresh_interpreter_process() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
