"""The fusion pattern table: one entry (name, pattern maker, check) per fusion, most specific first.

Each check either rejects a match with a recorded reason (the module stays unchanged there) or accepts
it; acceptance goes through `common.accept`, so the decide stage can run the table as a dry run that
records every candidate, and the fuse stage can then fuse exactly the chosen ones.
"""

from __future__ import annotations

from typing import Callable

from tvm.relax.transform import FusionPattern, PatternCheckContext

from tvmfuse.patterns.attention import check_attention, check_rotary_embedding, make_attention_pattern, \
    make_rotary_embedding_pattern, rotary_embedding_name
from tvmfuse.patterns.builders import Annotated
from tvmfuse.patterns.common import Match, Recorder, check_private_intermediates, current, reject, start, stop
from tvmfuse.patterns.matmul import check_geglu, check_matmul, check_matmul_act, check_matmul_bias, check_matmul_multiply, \
    check_swiglu, make_geglu_pattern, make_matmul_act_pattern, make_matmul_bias_pattern, make_matmul_multiply_pattern, \
    make_matmul_pattern, make_swiglu_pattern
from tvmfuse.patterns.norms import (check_layer_norm_gelu, check_rms_norm, check_rms_norm_residual, check_skip_layer_norm,
                    check_skip_layer_norm_bias, make_layer_norm_gelu_pattern, make_rms_norm_pattern,
                    make_rms_norm_residual_pattern, make_skip_layer_norm_bias_pattern, make_skip_layer_norm_pattern)

Check = Callable[[PatternCheckContext], bool]

#: The table. FuseOpsByPattern gives earlier entries priority, so the most specific come first; the decide
#: stage resolves overlaps by predicted benefit, so order only breaks exact ties.
PATTERN_TABLE: list[tuple[str, Callable[[], Annotated], Check]] = [
    ("tvmfuse.attention", make_attention_pattern, check_attention),
    ("tvmfuse.swiglu", make_swiglu_pattern, check_swiglu),
    ("tvmfuse.geglu", make_geglu_pattern, check_geglu),
    *[(rotary_embedding_name(*v), make_rotary_embedding_pattern(*v), check_rotary_embedding(*v))  # (sliced, partial)
      for v in ((True, True), (False, True), (True, False), (False, False))],
    ("tvmfuse.rms_norm_residual", make_rms_norm_residual_pattern, check_rms_norm_residual),
    ("tvmfuse.rms_norm", make_rms_norm_pattern, check_rms_norm),
    ("tvmfuse.skip_layer_norm_bias", make_skip_layer_norm_bias_pattern, check_skip_layer_norm_bias),
    ("tvmfuse.skip_layer_norm", make_skip_layer_norm_pattern, check_skip_layer_norm),
    ("tvmfuse.layer_norm_gelu", make_layer_norm_gelu_pattern, check_layer_norm_gelu),
    *[(f"tvmfuse.matmul_bias_{a}", make_matmul_bias_pattern(a), check_matmul_bias(a))
      for a in ("gelu", "gelu_tanh", "silu", "relu", "tanh")],
    *[(f"tvmfuse.matmul_{a}", make_matmul_act_pattern(a), check_matmul_act(a))
      for a in ("gelu", "gelu_tanh", "silu", "relu", "tanh")],
    ("tvmfuse.matmul_bias", make_matmul_bias_pattern(None), check_matmul_bias(None)),
    ("tvmfuse.matmul_multiply", make_matmul_multiply_pattern, check_matmul_multiply),  # after matmul_silu's own
    ("tvmfuse.matmul", make_matmul_pattern, check_matmul),  # the layout stage's [N, K] weights, read in place
]


def fusion_patterns(names: list[str] | None = None) -> list[FusionPattern]:
    """The table as FusionPatterns for FuseOpsByPattern, optionally only the named entries."""
    out = []
    for name, make, check in PATTERN_TABLE:
        if names is None or name in names:
            root, annotations = make()
            out.append(FusionPattern(name, root, {**annotations, "root": root}, check, _candidate_attrs))
    return out


def _candidate_attrs(annotated) -> dict[str, str]:
    """Tag each fused function with the candidate it came from (pattern@root), for the report."""
    rec = current()
    root = annotated.get("root") if rec is not None else None
    for expr, (pattern, var) in (rec.accepted if rec is not None else []):
        if root is not None and expr.same_as(root):
            return {"tvmfuse.candidate": f"{pattern}@{var}"}
    return {}


__all__ = ["PATTERN_TABLE", "fusion_patterns", "check_private_intermediates", "reject", "Recorder", "Match", "start", "stop"]
