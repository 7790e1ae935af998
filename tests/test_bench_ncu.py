"""bench/ncu_summary.py: the per-instruction stall table it reads out of an Nsight Compute report."""

from bench.ncu_summary import KEEP, stalls_by_pc, stalls_from_source_page


class _Ids:
    def __init__(self, pcs):
        self.pcs = pcs

    def as_uint64(self, i):
        return self.pcs[i]


class _Metric:
    def __init__(self, per_pc: dict):
        self.pcs, self.values = list(per_pc), list(per_pc.values())

    def num_instances(self):
        return len(self.values)

    def has_correlation_ids(self):
        return True

    def correlation_ids(self):
        return _Ids(self.pcs)

    def as_double(self, i):
        return self.values[i]


class _Action:
    """What ncu_report's IAction answers for three sampled instructions."""

    metrics = {"smsp__pcsamp_sample_count": _Metric({0x10: 50.0, 0x20: 30.0, 0x30: 0.0}),
               "smsp__pcsamp_warps_issue_stalled_long_scoreboard": _Metric({0x10: 40.0, 0x20: 2.0}),
               "smsp__pcsamp_warps_issue_stalled_wait": _Metric({0x10: 10.0, 0x20: 28.0}),
               "smsp__pcsamp_warps_issue_stalled_wait_not_issued": _Metric({0x10: 9.0}),
               "sm__cycles_elapsed.avg": _Metric({})}

    def metric_names(self):
        return list(self.metrics)

    def metric_by_name(self, name):
        return self.metrics[name]

    def sass_by_pc(self, pc):
        return {0x10: "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2", 0x20: "WARPGROUP.DEPBAR.LE gsb0, 0x1"}[pc]


def test_stalls_by_pc_ranks_instructions_by_samples_with_their_largest_reasons():
    rows = stalls_by_pc(_Action(), top=5)
    assert [r["pc"] for r in rows] == [0x10, 0x20]  # 0x30: no samples
    assert rows[0]["samples"] == 50.0 and rows[0]["sass"].startswith("SYNCS.PHASECHK")
    assert list(rows[0]["stalls"]) == ["long_scoreboard", "wait"]  # largest first; *_not_issued left out
    assert rows[1]["stalls"] == {"wait": 28.0, "long_scoreboard": 2.0}
    assert len(stalls_by_pc(_Action(), top=1)) == 1


def test_the_kept_metrics_are_the_time_clock_throughputs_and_the_tensor_pipe():
    names = ["gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second",
             "sm__throughput.avg.pct_of_peak_sustained_elapsed",
             "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active", "dram__bytes_read.sum",
             "sm__cycles_elapsed.avg", "dram__bytes_read.sum.per_second",
             "smsp__average_warp_latency_issue_stalled_wait", "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"]
    assert [n for n in names if KEEP.search(n)] == names[:5]  # whole names only: no unit or rollup variants


def test_the_stall_table_is_read_from_the_source_page(tmp_path):
    page = tmp_path / "source.csv"
    head = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
            '"stall_long_sb","stall_wait","stall_long_sb (Not Issued)"')
    page.write_text("\n".join([
        '"Kernel Name","gemm_kernel",', head,
        '"0x10","@!P0 BRA 0x2840","60","50","55","5","50"',
        '"0x20","HGMMA.64x128x16.F32 R24, gdesc[UR4], R24","40","1","0","40","0"',
        '"Kernel Name","other",', head, '"0x10","EXIT","10","0","0","10","0"']))
    got = stalls_from_source_page(str(page), top=1)
    assert set(got) == {"gemm_kernel", "other"}
    assert got["gemm_kernel"]["samples"] == 100 and got["gemm_kernel"]["stall_pct"] == {"long_sb": 55.0, "wait": 45.0}
    assert got["gemm_kernel"]["top"] == [{"sass": "@!P0 BRA 0x2840", "pct": 60.0,
                                          "stalls_pct": {"long_sb": 55.0, "wait": 5.0}}]
