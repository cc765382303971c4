"""The forms a linear layer's weight takes between the checkpoint and the kernel.

Every checkpoint format unpacks into one of these, whatever its packing on disk; every
platform's linear method starts from one of these. So a format never knows which device runs
it, and a kernel never knows which format its weight came from.

- ``torch.Tensor``: a dense weight ``[N, K]``.
- ``GroupQuantWeight``: integers with a scale and an offset per group of input columns.
- ``Fp8Weight``: float8 e4m3 values with a scale per output row.
- ``BlockFp8Weight``: float8 e4m3 values with a scale per tile of rows and columns.
- ``PackedIntWeight``: a ``GroupQuantWeight`` whose offsets are integer zero points, its codes
  packed along K as the fused MoE kernel reads them (made at load from the grouped form,
  never by a format).

Each form's ``dequantize`` also reads tensors with leading dimensions (a stack of experts'
weights, ``quant.expert_stack``): ``[..., N, K]`` values with their scales ``[..., ...]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.errors import ConfigError


@dataclass
class GroupQuantWeight:
    """``W[n, k] = values[n, k] * scales[n, k // group_size] + offsets[n, k // group_size]``.

    An offset rather than an integer zero point covers both conventions in use: AWQ and GPTQ
    store ``(q - z) * s`` (offset ``-z * s``), GGUF's Q4_1 stores ``q * d + m`` (offset ``m``).

    ``input_perm`` (GPTQ act-order): column ``j`` here is column ``input_perm[j]`` of the
    checkpoint's weight, so the layer computes ``x[:, input_perm] @ W.T``. Sorting the columns
    by group once at load makes every group contiguous.
    """

    values: torch.Tensor  # uint8 [N, K], each in 0 .. 2**bits - 1
    scales: torch.Tensor  # float32 [N, ceil(K / group_size)]
    offsets: torch.Tensor  # float32 [N, ceil(K / group_size)]
    bits: int
    group_size: int
    input_perm: torch.Tensor | None = None  # int64 [K]

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @classmethod
    def quantize(cls, dense: torch.Tensor, bits: int, group_size: int) -> GroupQuantWeight:
        """Symmetric round-to-nearest, as GGUF's Q8_0 and Q4_0 do: per group, the largest
        magnitude maps to the largest positive code, the scale rounded to float16 as those
        formats (and AWQ, GPTQ) store it (used by benchmarks to make a quantized model of a
        float one, so kernels see the scales real checkpoints have)."""
        n, k = dense.shape
        groups = -(-k // group_size)
        padded = torch.nn.functional.pad(dense.float(), (0, groups * group_size - k))
        blocks = padded.view(n, groups, group_size)
        half = 2 ** (bits - 1)
        scales = blocks.abs().amax(dim=-1) / (half - 1)
        rounded = scales.half().float()
        scales = torch.where(rounded > 0, rounded, scales)  # float32 where float16 underflows
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = (blocks / scales[..., None]).round().clamp(-half, half - 1) + half
        values = codes.view(n, -1)[:, :k].to(torch.uint8)
        return cls(values.contiguous(), scales, -half * scales, bits, group_size)

    def group_of_column(self) -> torch.Tensor:
        return torch.arange(self.values.shape[-1], device=self.values.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight in the checkpoint's column order, computed in ``dtype``
        (float32 is exact for every format read here: 8-bit values times fp16 scales)."""
        groups = self.group_of_column()
        dense = (self.values.to(dtype) * self.scales.to(dtype)[..., groups]
                 + self.offsets.to(dtype)[..., groups])
        if self.input_perm is None:
            return dense
        # Column j goes back to column input_perm[j] (a stack: each expert's own order).
        perm = self.input_perm.unsqueeze(-2).expand(dense.shape)
        return torch.empty_like(dense).scatter_(-1, perm, dense)


@dataclass
class Fp8Weight:
    """``W[n, k] = float(values[n, k]) * scales[n]``; a per-tensor scale is repeated per row,
    so the shards of a fused layer concatenate. ``input_scale``: a static activation scale
    (None: scaled per token at run time)."""

    values: torch.Tensor  # float8_e4m3fn [N, K]
    scales: torch.Tensor  # float32 [N]
    input_scale: float | None = None

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @classmethod
    def quantize(cls, dense: torch.Tensor) -> Fp8Weight:
        """``--quantization fp8``: one scale per output row, mapping its largest magnitude to
        e4m3's largest finite value, with no activation scale (scaled per token)."""
        dense = dense.float()
        fmax = torch.finfo(torch.float8_e4m3fn).max
        scales = (dense.abs().amax(dim=1) / fmax).clamp(min=torch.finfo(torch.float32).tiny)
        values = (dense / scales[:, None]).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
        return cls(values, scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.values.to(dtype) * self.scales.to(dtype)[..., None]


@dataclass
class BlockFp8Weight:
    """``W[n, k] = float(values[n, k]) * scales[n // block[0], k // block[1]]``: one scale per
    tile of ``block`` rows and columns (DeepSeek-V3's and Qwen3-FP8's ``weight_scale_inv``,
    128 x 128); the last tiles of a row or a column may be partial. No platform multiplies by
    it as it is: dense layers dequantize it at load, experts per step."""

    values: torch.Tensor  # float8_e4m3fn [N, K]
    scales: torch.Tensor  # float32 [ceil(N / block[0]), ceil(K / block[1])]
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        (n, k), (bn, bk) = self.values.shape[-2:], self.block
        scales = self.scales.to(dtype).repeat_interleave(bn, dim=-2)[..., :n, :]
        return self.values.to(dtype) * scales.repeat_interleave(bk, dim=-1)[..., :k]


@dataclass
class PackedIntWeight:
    """``W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g]``, ``g = k // group_size``: a
    ``GroupQuantWeight`` whose offsets are ``-zeros * scales`` with integer zero points in
    ``0 .. 2**bits - 1`` (AWQ, GPTQ, compressed-tensors int4, GGUF Q4_0 and Q8_0; not GGUF
    Q4_1's minimum, nor act-order's permuted columns), its codes ``q`` packed along K:
    4-bit two a byte (``pack_nibbles``), 8-bit one a byte. So ``q - z`` is an integer of at
    most 8 bits, exact in any 16-bit float, and the scale can multiply a sum of products."""

    values: torch.Tensor  # uint8 [N, ceil(K * bits / 8)]
    scales: torch.Tensor  # float32 [N, ceil(K / group_size)]
    zeros: torch.Tensor  # uint8 [N, ceil(K / group_size)]
    bits: int
    group_size: int
    columns: int  # K

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.values.shape[:-1], self.columns))

    @classmethod
    def from_group(cls, weight: GroupQuantWeight) -> PackedIntWeight | None:
        """``weight`` (or a stack of them) in this form, or None where it has none."""
        if weight.input_perm is not None or weight.bits not in (4, 8):
            return None
        zeros = zero_points(weight.scales, weight.offsets, weight.bits)
        if zeros is None:
            return None
        values = pack_nibbles(weight.values) if weight.bits == 4 else weight.values
        return cls(values.contiguous(), weight.scales.float().contiguous(), zeros, weight.bits,
                   weight.group_size, weight.shape[-1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = unpack_nibbles(self.values, self.columns) if self.bits == 4 else self.values
        groups = torch.arange(self.columns, device=q.device) // self.group_size
        return ((q.to(dtype) - self.zeros.to(dtype)[..., groups])
                * self.scales.to(dtype)[..., groups])


def zero_points(scales: torch.Tensor, offsets: torch.Tensor, bits: int) -> torch.Tensor | None:
    """uint8 ``z`` with ``offsets == -z * scales`` exactly, each in ``0 .. 2**bits - 1`` (any
    ``z`` where a scale is 0 and its offset too: 0), or None where there is none."""
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    z = (-offsets / safe).round().clamp(0, 2**bits - 1)
    if not torch.equal(-z * scales, offsets):
        return None
    return z.to(torch.uint8)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K]`` of values 0..15 -> ``[..., ceil(K / 2)]``: column ``2j`` in the low
    nibble of byte ``j``, column ``2j + 1`` in its high nibble (an odd K padded with 0)."""
    if values.shape[-1] % 2:
        values = torch.nn.functional.pad(values, (0, 1))
    return values[..., 0::2] | (values[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, columns: int) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)[..., :columns]


LoadedWeight = torch.Tensor | GroupQuantWeight | Fp8Weight | BlockFp8Weight


def dequantize(weight: LoadedWeight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()


def concat_shards(shards: list[LoadedWeight]) -> LoadedWeight:
    """One weight from the output shards of a fused layer (q/k/v, gate/up), in order.

    Shards of one kind stay quantized: 4-bit and 8-bit shards of one group size meet in 8-bit
    values (a 4-bit value is a valid 8-bit one, its offsets unchanged). Shards that cannot meet
    (different kinds, group sizes or act-order permutations) are dequantized, as block FP8
    shards are (no platform keeps a dense layer in block FP8).
    """
    if len(shards) == 1:
        return shards[0]
    first = shards[0]
    if all(isinstance(s, GroupQuantWeight) for s in shards) and _groups_match(shards):
        return GroupQuantWeight(
            torch.cat([s.values for s in shards]), torch.cat([s.scales for s in shards]),
            torch.cat([s.offsets for s in shards]), max(s.bits for s in shards),
            first.group_size, first.input_perm)
    if all(isinstance(s, Fp8Weight) for s in shards):
        static = [s.input_scale for s in shards]
        return Fp8Weight(torch.cat([s.values for s in shards]),
                         torch.cat([s.scales for s in shards]),
                         None if None in static else max(static))
    return torch.cat([dequantize(s).float() for s in shards])


def _groups_match(shards: list[GroupQuantWeight]) -> bool:
    first = shards[0]
    for s in shards[1:]:
        if s.group_size != first.group_size:
            return False
        if (s.input_perm is None) != (first.input_perm is None):
            return False
        if s.input_perm is not None and not torch.equal(s.input_perm, first.input_perm):
            return False
    return True


def take_rows(weight: LoadedWeight, start: int, size: int) -> LoadedWeight:
    """Output rows ``[start, start + size)`` of a weight (a tensor-parallel rank's slice of a
    column-parallel layer); rows past the end are zeros (a padded vocabulary partition). Block
    FP8 weights are cut between their blocks (a ``ConfigError`` where a cut would not be)."""
    if isinstance(weight, torch.Tensor):
        return _rows(weight, start, size)
    if isinstance(weight, GroupQuantWeight):
        return GroupQuantWeight(_rows(weight.values, start, size),
                                _rows(weight.scales, start, size),
                                _rows(weight.offsets, start, size), weight.bits,
                                weight.group_size, weight.input_perm)
    if isinstance(weight, BlockFp8Weight):
        bn = weight.block[0]
        _check_block_cut(start, size, weight.shape[0], bn, "output rows of a column-parallel "
                         "layer")
        return BlockFp8Weight(_rows(weight.values, start, size),
                              _rows(weight.scales, start // bn, -(-size // bn)), weight.block)
    return Fp8Weight(_rows(weight.values, start, size), _rows(weight.scales, start, size),
                     weight.input_scale)


def take_columns(weight: LoadedWeight, start: int, size: int) -> LoadedWeight:
    """Input columns ``[start, start + size)`` (a row-parallel rank's slice). Grouped and block
    FP8 weights are cut between their groups or blocks; a ``ConfigError`` where a cut would
    fall inside one or the columns are permuted (GPTQ act-order)."""
    if isinstance(weight, torch.Tensor):
        return weight[:, start:start + size]
    if isinstance(weight, Fp8Weight):  # scales are per output row: unchanged
        return Fp8Weight(weight.values[:, start:start + size], weight.scales,
                         weight.input_scale)
    if isinstance(weight, BlockFp8Weight):
        bk = weight.block[1]
        _check_block_cut(start, size, weight.shape[1], bk, "input columns of a row-parallel "
                         "layer")
        return BlockFp8Weight(weight.values[:, start:start + size],
                              weight.scales[:, start // bk:-(-(start + size) // bk)],
                              weight.block)
    if weight.input_perm is not None:
        raise ConfigError("--tensor-parallel-size: GPTQ act-order (desc_act) weights cannot be "
                          "split across ranks; use --tensor-parallel-size 1")
    if weight.scales.shape[1] == 1:  # one group per row (per channel): it splits anywhere
        return GroupQuantWeight(weight.values[:, start:start + size], weight.scales,
                                weight.offsets, weight.bits, size)
    g = weight.group_size
    if start % g or size % g:
        raise ConfigError(
            f"--tensor-parallel-size: a rank's {size} input columns of a row-parallel layer do "
            f"not fall on the quantization groups of {g}; use a smaller --tensor-parallel-size")
    return GroupQuantWeight(weight.values[:, start:start + size],
                            weight.scales[:, start // g:(start + size) // g],
                            weight.offsets[:, start // g:(start + size) // g],
                            weight.bits, g)


def _check_block_cut(start: int, size: int, length: int, block: int, what: str) -> None:
    """A ``ConfigError`` unless ``[start, start + size)`` begins on an FP8 block and ends on
    one (or at ``length``): a rank cannot hold part of a block's scale."""
    if start % block or (size % block and start + size < length):
        raise ConfigError(
            f"--tensor-parallel-size: a rank's {size} {what} do not fall on the FP8 blocks of "
            f"{block} (quantization_config.weight_block_size); use a smaller "
            f"--tensor-parallel-size")


def _rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    part = t[start:start + size]
    missing = size - part.shape[0]
    if missing == 0:
        return part
    return torch.cat([part, part.new_zeros((missing, *t.shape[1:]))])
