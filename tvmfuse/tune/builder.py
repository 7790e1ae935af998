"""MetaSchedule builder function, kept free of tvmfuse imports: builder workers unpickle it by reference."""


def _register_mma_index_maps() -> None:
    """The two index maps mma.sync lowering looks up by name, which only importing tvm.s_tir.tensor_intrin (~16 s
    per worker, registering every intrinsic) would register: the same formulas as tvm/s_tir/tensor_intrin/cuda.py's
    `index_map_m16n8k8_matrixC` and `shared_16x16_to_ldmatrix_32x8_layout`. Without them no mma candidate built in
    a tuner worker ("index_map_func.has_value()")."""
    import tvm  # pylint: disable=import-outside-toplevel
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    if tvm_ffi.get_global_func("tirx.index_map_m16n8k8.matrixC", allow_missing=True) is None:
        tvm_ffi.register_global_func("tirx.index_map_m16n8k8.matrixC", lambda ind: tvm.runtime.convert(
            [(ind[0] // 8) // 2, ind[1] // 8, (ind[0] // 8) % 2, (ind[1] % 8) % 2]))
    if tvm_ffi.get_global_func("tirx.index_map.shared_16x16_to_ldmatrix_32x8_layout", allow_missing=True) is None:
        tvm_ffi.register_global_func("tirx.index_map.shared_16x16_to_ldmatrix_32x8_layout", lambda ind: tvm.runtime.convert(
            [4 * (ind[0] % 8) + (ind[1] % 8) // 2, 4 * (ind[1] // 8) + (ind[0] // 8) * 2 + ind[1] % 2]))


TIRX_ATTR = "tvmfuse.tirx"  # tvmfuse.kernels.hopper.wgmma_gemm.TIRX_ATTR, spelled out: this module imports no tvmfuse


def fast_build(mod, target, _params):
    """f_build that skips importing the tensor intrinsics in every worker (15-30 s each on a 2-core box); a module
    of TIRx kernels (the knob sets of the Hopper templates, marked TIRX_ATTR) goes through the tirx pipeline."""
    from tvm.tirx import build as tvm_build  # pylint: disable=import-outside-toplevel
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock  # pylint: disable=import-outside-toplevel

    import tvm  # pylint: disable=import-outside-toplevel

    if any(TIRX_ATTR in (getattr(f, "attrs", None) or {}) for f in mod.functions.values()):
        return tvm_build(mod, target, "tirx")
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    if target.kind.name == "cuda":
        _register_mma_index_maps()
    # cp.async for software-pipelined shared-memory copies (tensor-core sketches); a no-op for other kernels
    outer = tvm.transform.PassContext.current()
    config = {**dict(outer.config), **({"tirx.use_async_copy": True} if target.kind.name == "cuda" else {})}
    with tvm.transform.PassContext(opt_level=outer.opt_level, config=config):
        return tvm_build(mod, target)
