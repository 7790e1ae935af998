"""The Hopper (sm_90a) kernels in TIRx: the wgmma GEMM (TMA, mbarrier ring), the small-M mma.sync GEMM and the
row-reduction kernel, each rebuilt from a fused kernel's analysis with its epilogue."""

from tvmfuse.kernels.hopper.select import (apply_hopper_kernels, choose_smallm_tile, choose_tile, is_hopper,
                                           sibling_merge_pays)
from tvmfuse.kernels.hopper.gemm_tiles import HOPPER_GEMMS, hopper_gemm_sites, measured_tiles
from tvmfuse.kernels.hopper.wgmma_gemm import TIRX_ATTR

__all__ = ["HOPPER_GEMMS", "TIRX_ATTR", "apply_hopper_kernels", "choose_smallm_tile", "choose_tile",
           "hopper_gemm_sites", "is_hopper", "measured_tiles", "sibling_merge_pays"]
