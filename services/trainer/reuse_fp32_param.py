"""MindSpeed's `reuse_fp32_param`: an fp32 master weight kept as its bf16 parameter plus a 16-bit residual.

`master bits = (bf16 bits << 16) + residual` exactly, so a master costs 2 bytes beside the parameter instead of
4. For that the parameter must be the master rounded to nearest with ties away from zero (MindSpeed's int32
trick) instead of torch's ties to even: the two differ only where the fp32 value lies exactly halfway between two
bf16 values. The optimizer (optimizer.py) rebuilds the masters only while Adam steps them.
"""

from __future__ import annotations

import torch

# Elements of bit arithmetic done at once (bounds the int32 temporaries).
_BITS_CHUNK = 1 << 24


def split_master(master: torch.Tensor, param: torch.Tensor, residual: torch.Tensor) -> None:
    """fp32 `master` -> bf16 `param` (nearest, ties away from zero) and int16 `residual`, in place (1-D).

    On the fp32 bits u: hi = (u + 0x8000) >> 16 and residual = u - (hi << 16), which lies in [-0x8000, 0x7fff],
    so `join_master` gives u back exactly. Only NaN bit patterns overflow.
    """
    bits = master.view(torch.int32)
    out = param.view(torch.int16)
    for i in range(0, bits.numel(), _BITS_CHUNK):
        u = bits[i : i + _BITS_CHUNK]
        hi = (u + 0x8000) >> 16
        residual[i : i + _BITS_CHUNK] = u - (hi << 16)
        out[i : i + _BITS_CHUNK] = hi


def join_master(param: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The fp32 master that `split_master` cut into bf16 `param` and int16 `residual` (1-D), bit for bit."""
    hi = param.view(torch.int16)
    out = torch.empty(hi.numel(), dtype=torch.int32, device=hi.device)
    for i in range(0, hi.numel(), _BITS_CHUNK):
        out[i : i + _BITS_CHUNK] = (hi[i : i + _BITS_CHUNK].to(torch.int32) << 16) + residual[i : i + _BITS_CHUNK]
    return out.view(torch.float32)
