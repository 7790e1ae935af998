"""bench/attention_sass.py's SASS reading on a hand-written listing (no nvcc): main-loop paths, classes, occupancy."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import attention_sass as sass

LISTING = """
\t\tFunction : gpu_kernel
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
        /*0010*/                   LDGSTS.E.BYPASS.128 [R158], desc[UR6][R2.64] ;   /* 0x0 */
        /*0020*/               @P0 BRA 0x0050 ;                                 /* 0x0 */
        /*0030*/                   MUFU.EX2 R3, R3 ;                            /* 0x0 */
        /*0040*/                   FSEL R4, R3, RZ, P1 ;                        /* 0x0 */
        /*0050*/                   LDSM.16.M88.4 R8, [R125] ;                   /* 0x0 */
        /*0060*/                   HMMA.16816.F32 R12, R8, R10, R12 ;           /* 0x0 */
        /*0070*/                   NOP ;                                        /* 0x0 */
        /*0080*/                   HMMA.16816.F32 R16, R8, R10, R16 ;           /* 0x0 */
        /*0090*/              @!P2 BRA 0x0010 ;                                 /* 0x0 */
        /*00a0*/                   STG.E.U16 desc[UR6][R2.64], R5 ;             /* 0x0 */
        /*00b0*/                   EXIT ;                                       /* 0x0 */
"""


def test_parse_sass_drops_nops_and_keeps_predicates():
    ins = sass.parse_sass(LISTING)["gpu_kernel"]
    assert len(ins) == 11
    assert ins[2] == (0x20, "@P0", "BRA", "0x0050")
    assert all(op != "NOP" for _, _, op, _ in ins)


def test_main_loop_paths_through_a_forward_branch():
    loop = sass.main_loop(sass.parse_sass(LISTING)["gpu_kernel"])
    assert (loop["head"], loop["back_edge"], loop["static_body"]) == ("0x10", "0x90", 8)
    assert loop["global_load_positions"] == [0]
    short, long_ = loop["paths"]
    assert (short["instructions"], short["HMMA"], short["non_HMMA_per_HMMA"]) == (6, 2, 2.0)  # branch taken
    assert (long_["instructions"], long_["classes"]["MUFU.EX2"], long_["classes"]["FSEL"]) == (8, 1, 1)
    assert long_["classes"]["HMMA.16816.F32"] == 2 and long_["classes"]["LDSM"] == 1 and long_["classes"]["LDGSTS"] == 1


def test_occupancy_on_sm90():
    # the prefill d128 kernel's figures: 166 registers and 70,928 B of shared memory allow 3 blocks of 4 warps each way
    occ = sass.occupancy(166, 128, 70928)
    assert (occ["blocks_per_sm"], occ["warps_per_sm"], occ["limited_by"]) == (3, 12, ["registers", "shared_memory"])
    assert sass.occupancy(255, 128, 56320)["blocks_by"]["registers"] == 2  # 8 warps: 2 per sub-partition
    assert sass.occupancy(24, 128, 0)["limited_by"] == ["warps"]  # 16 blocks of 4 warps fill the 64 warps
