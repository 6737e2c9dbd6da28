"""The one table of KV dtypes kvcodec stores: names as written in headers and metas <-> torch dtypes."""

from __future__ import annotations

import torch

from kvcodec.errors import FormatError

DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
SAME_SIZE_INT: dict[torch.dtype, torch.dtype] = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
}


def dtype_of(name: object, what: str = "dtype") -> torch.dtype:
    """The torch dtype named `name` in a header; FormatError naming `what` when it is not one."""
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise FormatError(f"{what} {name!r} is not one of {', '.join(DTYPES)}")
    return dtype


def name_of(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]
