"""tvmfuse: fuse transformer operators and tune the fused kernels with Apache TVM."""
