"""Decide stage: dry-run the pattern table, score each candidate with the analytic cost model, keep the best
non-overlapping set above the threshold, and report why (the fusion report)."""

from tvmfuse.decide.decision import Candidate, Plan, Settings, decide
from tvmfuse.decide.report import format_text, fusion_report, report_files

__all__ = ["Candidate", "Plan", "Settings", "decide", "format_text", "fusion_report", "report_files"]
