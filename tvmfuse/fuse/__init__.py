"""Fuse stage: the kept candidates become one PrimFunc each (opmath groups in fp32, one-kernel splits, tvmfuse's
legalizations), the rest gets TVM's FuseOps; buckets add static copies of `main` for named sizes."""

from tvmfuse.fuse.buckets import (Bucketed, add_dispatch, bucket_shapes, check_buckets, function_name,
                                  lower_buckets, verification_dims)
from tvmfuse.fuse.fusion import DEFAULT_FUSION, Fused, called_prim_funcs, kernel_calls, launches, lower, symbolic_kernels

__all__ = ["Bucketed", "DEFAULT_FUSION", "Fused", "add_dispatch", "bucket_shapes", "called_prim_funcs",
           "check_buckets", "function_name", "kernel_calls", "launches", "lower", "lower_buckets", "symbolic_kernels",
           "verification_dims"]
