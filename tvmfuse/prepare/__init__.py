"""Prepare stage: the imported module as the later stages see it: weights bound, operators that change nothing gone,
attention masks at the scores' rank (mask_rank), kernels computing in the compute dtype (precision, interface
dtypes, opmath), constant weights stored [N, K] (layout)."""

from __future__ import annotations

import tvm
from tvm import relax

from tvmfuse.prepare.layout import transpose_weights
from tvmfuse.prepare.mask_rank import full_rank_masks
from tvmfuse.prepare.no_ops import drop_no_ops
from tvmfuse.prepare.precision import to_compute_dtype
from tvmfuse.prepare.siblings import MergeRule, merge_sibling_matmuls


def bind_params(mod: tvm.IRModule, params: list | None) -> tvm.IRModule:
    """Bind the detached weights back as constants (kept out of fused functions: bind_constants=False); a weight
    read in another dtype than its param's (the importer's `weight_dtype`) is bound through a cast to it."""
    if not params:
        return mod
    main = mod["main"]
    weights = main.params[int(main.attrs["num_input"]):]
    if all(str(t.dtype) == str(v.ty.dtype) for v, t in zip(weights, params)):
        return relax.transform.BindParams("main", {v.name: t for v, t in zip(weights, params)})(mod)
    bb = relax.BlockBuilder()
    binding = {v: relax.const(t) if str(t.dtype) == str(v.ty.dtype)
               else bb.normalize(relax.op.astype(relax.const(t), str(v.ty.dtype))) for v, t in zip(weights, params)}
    out = mod.clone()
    out.update_func(out.get_global_var("main"), main.bind_params(binding))
    return out


def prepare_module(imported, dtype: str = "fp32", io_dtype: str | None = None,
                   low_lookups: bool = True, one_copy: bool = False, merge_pays: MergeRule | None = None,
                   merged: list | None = None, merge_sizes: list[dict[str, int]] | None = None) -> tvm.IRModule:
    """The imported model as decide and fuse see it: weights bound as constants, operators that change nothing
    gone (`no_ops`: reshapes to their input's own shape, whole-tensor slices, zero-width concat parts), rank-2/3
    attention masks read as rank 4 (`mask_rank.full_rank_masks`), precision (fp16/bf16 kernels),
    sibling projections merged where `merge_pays` says so (`siblings.merge_sibling_matmuls`; `merged` gets each
    group; symbolic row counts are judged at each of `merge_sizes`, the build's bucket shapes), then the weight
    layout (constant weights [N, K], read through a permute the kernel absorbs).
    `one_copy` (big models): `imported.params` is emptied once bound and the layout transposes in place (no second
    copy)."""
    bound = full_rank_masks(drop_no_ops(bind_params(imported.mod, imported.params)))
    if one_copy:
        imported.params = []  # the module's constants are the one copy of the weights from here on
    computing = merge_sibling_matmuls(to_compute_dtype(bound, dtype, io_dtype, low_lookups), merge_pays, merged,
                                      merge_sizes)
    return transpose_weights(computing, in_place=one_copy)


__all__ = ["bind_params", "prepare_module"]
