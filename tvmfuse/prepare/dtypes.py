"""Compute and interface dtypes: the spellings users write (fp16, bfloat16...) and the pairs a module allows."""

from __future__ import annotations

from tvmfuse.errors import JobError

#: accepted spellings (CLI `--dtype`, jobs files `dtype = "..."`) -> the compute dtype (see tvmfuse.prepare.precision)
DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
                 "bf16": "bfloat16", "bfloat16": "bfloat16"}


def parse_dtype(text, where: str = "--dtype") -> str:
    """'fp16' / 'float16' -> 'float16' (likewise fp32, bf16); anything else is one JobError."""
    dtype = DTYPE_ALIASES.get(text.strip().lower()) if isinstance(text, str) else None
    if dtype is None:
        raise JobError(f"{where} {text!r} is not supported: use fp32, fp16 or bf16")
    return dtype


def check_io_dtype(io_dtype: str, dtype: str, where: str = "--io-dtype") -> str:
    """The interface dtype, which must be fp32 or the compute dtype (a module takes and returns one or the other)."""
    io_dtype = parse_dtype(io_dtype, where)
    if io_dtype not in ("float32", dtype):
        raise JobError(f"{where} {io_dtype} does not fit compute dtype {dtype}: use fp32 or the compute dtype")
    return io_dtype
