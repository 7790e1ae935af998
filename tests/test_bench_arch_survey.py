"""bench/arch_survey.py: each architecture's tiny export built and verified by the CLI, one row each."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import arch_survey  # noqa: E402


def test_an_unknown_architecture_is_one_error_line(tmp_path, capsys):
    assert arch_survey.main(["--out", str(tmp_path / "s.json"), "--only", "qwen3,nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --only") and "nope" in err[0]
    assert not (tmp_path / "s.json").exists()


@pytest.mark.slow
def test_a_row_says_the_export_verified_and_what_fused(tmp_path):
    pytest.importorskip("transformers")
    row = arch_survey.survey("mistral", "legacy", str(tmp_path / "work"))  # a folder it makes
    assert row["exported"] and row["exit"] == 0 and row["verification"] == "passed", row
    assert row["max_abs_err"] < 1e-4 and row["fused"]["tvmfuse.attention"] == 2, row
