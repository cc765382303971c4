"""Which accelerators the tests can use.

ROCm's torch answers ``torch.cuda.is_available()`` too, and the cuda platform refuses it, so
NVIDIA-only tests ask ``HAS_NVIDIA``, never ``torch.cuda.is_available()`` alone.
"""

from __future__ import annotations

import torch

HAS_NVIDIA = torch.cuda.is_available() and torch.version.hip is None
HAS_ROCM = torch.cuda.is_available() and torch.version.hip is not None
NVIDIA_REASON = "needs an NVIDIA GPU (torch.cuda without ROCm)"
