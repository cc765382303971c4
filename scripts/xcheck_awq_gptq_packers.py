"""Check tests/quant/packers.py and pagedserve's AWQ/GPTQ unpackers against AutoAWQ's and
AutoGPTQ's own packing and dequantizing code, and print the words the tests embed.

Neither package installs on a CPU-only machine with its dependencies, so this loads the few
files it needs from their unpacked distributions, by path (stubbing ``accelerate``, which
AutoAWQ's utils import and never use here):

    pip download autoawq==0.2.9 --no-deps -d /tmp/xref && tar xzf /tmp/xref/autoawq-0.2.9.tar.gz -C /tmp/xref
    pip download auto-gptq==0.7.1 --no-deps --only-binary :all: --python-version 3.11 \
        --platform manylinux_2_17_x86_64 -d /tmp/xref && unzip -q /tmp/xref/auto_gptq-*.whl -d /tmp/xref/gptq
    PYTHONPATH=. python scripts/xcheck_awq_gptq_packers.py /tmp/xref/autoawq-0.2.9 /tmp/xref/gptq
"""  # noqa: E501

from __future__ import annotations

import importlib.util
import sys
import types

import torch

from pagedserve.quant.formats.awq import AwqFormat
from pagedserve.quant.formats.gptq import GptqFormat
from tests.quant.packers import pack_awq, pack_gptq, quantize


def load_upstream(awq_root: str, gptq_root: str):
    for pkg in ["awq", "awq.modules", "awq.modules.linear", "awq.utils"]:
        module = types.ModuleType(pkg)
        module.__path__ = [f"{awq_root}/{pkg.replace('.', '/')}"]
        sys.modules[pkg] = module
    sys.modules["accelerate"] = types.ModuleType("accelerate")
    import awq.modules.linear.gemm as gemm
    import awq.utils.packing_utils as packing_utils

    del sys.modules["accelerate"]  # transformers, imported next, looks for the real one
    path = f"{gptq_root}/auto_gptq/nn_modules/qlinear/qlinear_cuda.py"
    spec = importlib.util.spec_from_file_location("qlinear_cuda", path)
    qlinear = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qlinear)
    return gemm, packing_utils, qlinear


def linear_of(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight.float()
    return linear


def check_awq(gemm, packing_utils) -> None:
    for n, k, group in [(32, 64, 32), (64, 128, 64), (96, 256, 128), (160, 128, 128)]:
        qz = quantize(torch.randn(n, k) * 0.1, 4, group, sym=False)
        ours = pack_awq(qz)
        up = gemm.WQLinear_GEMM.from_linear(
            linear_of(qz.dequantized()), 4, group, scales=qz.scales.T.float().contiguous(),
            zeros=qz.zeros.T.float().contiguous())
        assert torch.equal(up.qweight, ours["qweight"]) and torch.equal(up.qzeros, ours["qzeros"])
        iw, iz = packing_utils.reverse_awq_order(
            *packing_utils.unpack_awq(ours["qweight"], ours["qzeros"], 4), 4)
        assert torch.equal((iw & 15).T.long(), qz.q) and torch.equal((iz & 15).T.long(), qz.zeros)
        mine = AwqFormat(group).unpack("m", ours)
        assert torch.equal(mine.dequantize().double(), qz.dequantized())


def check_gptq(qlinear) -> None:
    for bits in (4, 8):
        for n, k, group, act_order, sym in [(32, 64, 32, False, True), (64, 128, 64, True, False),
                                            (32, 128, -1, False, False),
                                            (96, 256, 128, True, True)]:
            perm = torch.randperm(k) if act_order else None
            qz = quantize(torch.randn(n, k) * 0.1, bits, group, sym, perm)
            # AutoGPTQ packs a zero of 0 as uint32(-1), spilling into every higher field.
            qz.zeros.clamp_(min=1)
            ours = pack_gptq(qz, v1=True)
            up = qlinear.QuantLinear(bits, group, k, n, bias=False)
            up.pack(linear_of(qz.dequantized()), qz.scales.float(), qz.zeros.clone(),
                    g_idx=qz.g_idx.to(torch.int32))
            assert torch.equal(up.qweight, ours["qweight"]) and torch.equal(up.qzeros,
                                                                            ours["qzeros"])
            # AutoGPTQ's torch path dequantizes with g_idx: x @ W.T for x = I is W.T.
            assert torch.equal(up(torch.eye(k)).double(), qz.dequantized().T)
            for v1 in (True, False):
                mine = GptqFormat(bits, group, v1).unpack("m", pack_gptq(qz, v1))
                assert torch.equal(mine.dequantize().double(), qz.dequantized())


def print_golden(gemm, qlinear) -> None:
    """The words test_awq.py and test_gptq.py embed: q[n, k] = (5n + 3k + 1) % 2**b,
    z[n] = (7n + 2) % (2**b - 1) + 1, N = K = 32, one group."""
    for bits in (4, 8):
        q = torch.tensor([[(5 * i + 3 * j + 1) % (1 << bits) for j in range(32)]
                          for i in range(32)])
        z = torch.tensor([[(7 * i + 2) % ((1 << bits) - 1) + 1] for i in range(32)])
        s = torch.full((32, 1), 0.5)
        linear = linear_of((q - z) * s)
        if bits == 4:
            up = gemm.WQLinear_GEMM.from_linear(linear, 4, 32, scales=s.T.contiguous(),
                                                zeros=z.T.float().contiguous())
            print("AutoAWQ qweight[:2]", up.qweight[:2].tolist(), "qzeros", up.qzeros.tolist())
        up = qlinear.QuantLinear(bits, -1, 32, 32, bias=False)
        up.pack(linear, s, z.clone(), g_idx=torch.zeros(32, dtype=torch.int32))
        print(f"AutoGPTQ {bits}-bit qweight[:, :2].T", up.qweight[:, :2].T.tolist(),
              "qzeros", up.qzeros.tolist())


def main() -> None:
    torch.manual_seed(0)
    gemm, packing_utils, qlinear = load_upstream(sys.argv[1], sys.argv[2])
    check_awq(gemm, packing_utils)
    check_gptq(qlinear)
    print("packers and unpackers agree with AutoAWQ and AutoGPTQ")
    print_golden(gemm, qlinear)


if __name__ == "__main__":
    main()
