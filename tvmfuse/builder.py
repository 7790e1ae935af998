"""MetaSchedule builder function, kept free of tvmfuse imports: builder workers unpickle it by reference."""


def fast_build(mod, target, _params):
    """f_build that skips importing the tensor intrinsics in every worker (notes §3.1)."""
    from tvm.driver import build as tvm_build  # pylint: disable=import-outside-toplevel
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock  # pylint: disable=import-outside-toplevel

    return tvm_build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)
