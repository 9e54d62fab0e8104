"""What a launched Triton kernel may be passed: tensor dtypes and scalar ranges against the
kernel's signature, checked before a launch so a kernel that passes on CPU (interpreted)
compiles for that signature on a GPU.

>>> import torch
>>> argument_problem("*fp32", torch.ones(2)) is None
True
>>> argument_problem("i8", 300)
"300 for a 'i8' parameter (an int in [-128, 127])"
"""

from __future__ import annotations

import torch

__all__ = ["argument_problem"]

_TORCH_TO_TRITON = {
    torch.bool: "i1",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int16: "i16",
    torch.uint16: "u16",
    torch.int32: "i32",
    torch.uint32: "u32",
    torch.int64: "i64",
    torch.uint64: "u64",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}
_INT_RANGES = {
    "i1": (0, 1),
    "u1": (0, 1),
    "i8": (-(2**7), 2**7 - 1),
    "u8": (0, 2**8 - 1),
    "i16": (-(2**15), 2**15 - 1),
    "u16": (0, 2**16 - 1),
    "i32": (-(2**31), 2**31 - 1),
    "u32": (0, 2**32 - 1),
    "i64": (-(2**63), 2**63 - 1),
    "u64": (0, 2**64 - 1),
}


def argument_problem(ty: str, arg: object) -> str | None:
    """Why ``arg`` cannot be passed for a parameter of Triton type ``ty`` (None: it can)."""
    if isinstance(arg, torch.Tensor):
        have = "*" + _TORCH_TO_TRITON.get(arg.dtype, str(arg.dtype))
        if ty in (have, "*u1" if have == "*i1" else have):
            return None
        return f"a {arg.dtype} tensor for a {ty!r} parameter"
    if ty.startswith("*"):
        return f"{type(arg).__name__} for a pointer parameter {ty!r}; pass a tensor"
    if ty in _INT_RANGES:
        lo, hi = _INT_RANGES[ty]
        if isinstance(arg, int) and lo <= arg <= hi:
            return None
        return f"{arg!r} for a {ty!r} parameter (an int in [{lo}, {hi}])"
    if ty.startswith(("fp", "bf")):
        return None if isinstance(arg, (int, float)) else f"{arg!r} for a {ty!r} parameter"
    return None
