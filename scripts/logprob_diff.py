"""The engine's logprobs against transformers' float64 on a tiny random-weight architecture of
``tests/tiny_models.py``, with config overrides, to find where a device's path goes wrong.

For each variant: the prompts teacher-forced (the prefill path's logprobs), then 24 greedy
tokens with their logprobs (the decode path's), each against transformers' float64 on the
same token sequences. Printed per prompt: the largest gap, and for decode the first step whose
gap passes 1e-3 (``-`` if none).

    python scripts/logprob_diff.py --arch gemma2 --device cuda \\
        --variant '{}' --variant '{"attn_logit_softcapping": null}' \\
        --variant '{"final_logit_softcapping": null}' --variant '{"head_dim": 32}'

``--ops`` bisects the CUDA platform's own pieces: ``torch-attention`` runs the torch paged
attention (the CPU platform's) in place of the Triton kernels, ``torch-layers`` the torch
norms, activations and rotary in place of the fused Triton ones.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve import SamplingParams  # noqa: E402
from tests.tiny_models import (  # noqa: E402
    hf_model_float64,
    make_llm,
    random_prompts,
    write_tiny_model,
)

PROMPTS = random_prompts("cuda-archs", [5, 33, 70, 129])  # test_architectures_cuda.py's
NEW_TOKENS = 24
OPS = ["triton", "torch-attention", "torch-layers"]
_TRITON: dict = {}


def reference(model, sequences: list[list[int]]) -> list[list[float]]:
    """transformers' float64 logprob of each token of each sequence after the ones before."""
    out = []
    for seq in sequences:
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)
        out.append([logprobs[i, seq[i + 1]].item() for i in range(len(seq) - 1)])
    return out


def engine(folder: Path, device: str, eager: bool):
    """The prompts' prefill logprobs, the greedy continuations and their logprobs."""
    llm = make_llm(folder, device=device, dtype="float32", enforce_eager=eager,
                   kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
    forced = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0,
                                                  prompt_logprobs=0), use_tqdm=False)
    prefill = [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]
               for o, p in zip(forced, PROMPTS)]
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                  ignore_eos=True, logprobs=0), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in greedy]
    decode = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
              for o in greedy]
    return prefill, tokens, decode


def use_torch_ops(which: str) -> None:
    """The CUDA platform's attention or layer ops replaced by the torch reference ones."""
    from pagedserve.attention.torch_paged import TorchPagedAttention
    from pagedserve.models.layer_ops import LayerOps
    from pagedserve.platforms.cuda.platform import CudaPlatform

    # The platform's own (bound) methods, kept from the first call.
    attention, layers = _TRITON.setdefault(
        "cuda", (CudaPlatform.attention_backend, CudaPlatform.layer_ops))
    CudaPlatform.attention_backend = classmethod(
        lambda cls: TorchPagedAttention if which == "torch-attention" else attention())
    CudaPlatform.layer_ops = classmethod(
        lambda cls: LayerOps if which == "torch-layers" else layers())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="gemma2", help="a tests/tiny_models.py architecture")
    p.add_argument("--device", default="cuda")
    p.add_argument("--graphs", action="store_true", help="replay CUDA graphs (default eager)")
    p.add_argument("--variant", action="append", default=None,
                   help="JSON config overrides, repeatable (default: one, none)")
    p.add_argument("--ops", action="append", choices=OPS, default=None,
                   help="whose kernels run, repeatable (default: triton)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp())
    for (i, text), ops in itertools.product(enumerate(args.variant or ["{}"]),
                                            args.ops or OPS[:1]):
        folder = write_tiny_model(root / f"v{i}", args.arch, **json.loads(text))
        if args.device == "cuda":
            use_torch_ops(ops)
        prefill, tokens, decode = engine(folder, args.device, not args.graphs)
        model = hf_model_float64(folder)
        ref_prefill = reference(model, PROMPTS)
        ref_full = reference(model, [p + t for p, t in zip(PROMPTS, tokens)])
        cells = []
        for p, ours, ref, dec, full in zip(PROMPTS, prefill, ref_prefill, decode, ref_full):
            gaps = [abs(a - b) for a, b in zip(dec, full[len(p) - 1:])]
            first = next((str(j) for j, g in enumerate(gaps) if g > 1e-3), "-")
            cells.append(f"{max(abs(a - b) for a, b in zip(ours, ref)):.1e} "
                         f"{max(gaps):.1e}@{first}")
        print(f"{ops:<15} {text:<40} prefill, decode@first: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
