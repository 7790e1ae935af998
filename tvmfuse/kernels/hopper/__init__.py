"""The Hopper (sm_90a) kernels in TIRx: the wgmma GEMM (TMA, mbarrier ring), the small-M mma.sync GEMM and the
row-reduction kernel, each rebuilt from a fused kernel's analysis with its epilogue."""

from tvmfuse.kernels.hopper.select import (apply_hopper_kernels, choose_smallm_tile, choose_tile, is_hopper,
                                           sibling_merge_pays)
from tvmfuse.kernels.hopper.wgmma_gemm import TIRX_ATTR

__all__ = ["TIRX_ATTR", "apply_hopper_kernels", "choose_smallm_tile", "choose_tile", "is_hopper", "sibling_merge_pays"]
