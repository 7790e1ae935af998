"""Sub-patterns every table entry builds with: the optional casts mixed precision puts around fp32 ops, constants."""

from __future__ import annotations

from tvm.relax.dpl import DFPattern, is_const, is_op

Annotated = tuple[DFPattern, dict[str, DFPattern]]  # what a pattern maker returns: the root and the named parts


def cast(p: DFPattern) -> DFPattern:
    """`p`, optionally followed by an `astype` (where mixed precision casts around an op computing in fp32)."""
    return is_op("relax.astype")(p) | p


def const() -> DFPattern:
    """A constant, or a scalar constant cast to the compute dtype: ToMixedPrecision writes fp16 ops' scalar
    operands as `astype(const)`, and FoldConstant (TVM 0.27) folds that cast for tensors but not for 0-d ones."""
    return is_const() | is_op("relax.astype")(is_const())


def upcast(p: DFPattern) -> DFPattern:
    """`p`, optionally cast from a float dtype to float32: the cast into an op that computes in fp32. Only a
    float-to-fp32 cast: a cast to the compute dtype that feeds other ops too (the model's input cast to fp16)
    and a cast from int stay outside the match (the kernel's input)."""
    src = p.has_dtype("float16") | p.has_dtype("bfloat16") | p.has_dtype("float32")
    return is_op("relax.astype")(src).has_dtype("float32") | p
