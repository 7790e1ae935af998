"""MetaSchedule builder function, kept free of tvmfuse imports: builder workers unpickle it by reference."""


def fast_build(mod, target, _params):
    """f_build that skips importing the tensor intrinsics in every worker (notes §3.1)."""
    from tvm.driver import build as tvm_build  # pylint: disable=import-outside-toplevel
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock  # pylint: disable=import-outside-toplevel

    import tvm  # pylint: disable=import-outside-toplevel

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    # cp.async for software-pipelined shared-memory copies (tensor-core sketches); a no-op for other kernels
    outer = tvm.transform.PassContext.current()
    config = {**dict(outer.config), **({"tirx.use_async_copy": True} if target.kind.name == "cuda" else {})}
    with tvm.transform.PassContext(opt_level=outer.opt_level, config=config):
        return tvm_build(mod, target=target)
