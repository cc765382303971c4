"""An fp8 (e4m3) KV tile as 16-bit words: two cache bytes per word, widened to fp16 in pairs.

Why words: the matmul over values reduces along keys, which are not contiguous in the cache, so
a tile of bytes reaches a ``tl.dot`` operand one byte per shared-memory load (Triton has no
byte transpose on sm_90). Read as int16 words the same tile takes the 16-bit path
(``ldmatrix``); each word then splits into its low byte (the even element of the pair) and its
high byte (the odd one), and the kernel runs one dot per half.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Two words in, four fp16 out: prmt gathers the low (then the high) bytes of both words into
# one 16-bit pair, and cvt widens an e4m3 pair exactly (sm_89+).
_SPLIT_PTX = tl.constexpr("""{
    .reg .b32 t;
    .reg .b16 lo, hi;
    prmt.b32 t, $2, 0, 0x0020;
    mov.b32 {lo, hi}, t;
    cvt.rn.f16x2.e4m3x2 $0, lo;
    prmt.b32 t, $2, 0, 0x0031;
    mov.b32 {lo, hi}, t;
    cvt.rn.f16x2.e4m3x2 $1, lo;
}""")


@triton.jit
def split_e4m3_pairs(words, PTX: tl.constexpr):
    """``(even, odd)`` fp16 tensors of ``words``' shape: its low and its high e4m3 bytes.

    ``PTX`` takes the two-instruction path above (NVIDIA only); without it the bytes are
    masked out and converted one by one (the interpreter, for tests).
    """
    if PTX:
        even, odd = tl.inline_asm_elementwise(
            _SPLIT_PTX, "=r,=r,r", [words], dtype=(tl.float16, tl.float16), is_pure=True,
            pack=2)
    else:
        even = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        odd = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return even, odd
