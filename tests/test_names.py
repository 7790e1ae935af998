"""prepare.names: repeated binding names made distinct, so unrelated candidates never overlap by name."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import relax as R

from tvmfuse.decide.decision import KEPT, decide
from tvmfuse.fuse.fusion import lower
from tvmfuse.prepare import bind_params
from tvmfuse.prepare.names import duplicate_names, unique_binding_names


@tvm.script.ir_module
class _TwoChains:
    """Chain 2 (other rows: its own kernel) binds the names chain 1 bound, as a dynamo export's layers 0 and 4 did."""

    @R.function
    def main(x: R.Tensor((8, 64), "float32"), y: R.Tensor((4, 64), "float32"), w1: R.Tensor((64, 64), "float32"),
             w2: R.Tensor((64, 64), "float32"), b: R.Tensor((64,), "float32")):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            t = R.matmul(x, w1)
            u = R.add(t, b)
            r1 = R.nn.relu(u)
            u = R.matmul(y, w2)
            t = R.add(u, b)
            r2 = R.nn.relu(t)
            gv = (r1, r2)
            R.output(gv)
        return gv


def _two_chains() -> tvm.IRModule:
    rng = np.random.default_rng(0)
    weights = [tvm.runtime.tensor(rng.standard_normal(s).astype("float32")) for s in ((64, 64), (64, 64), (64,))]
    return bind_params(_TwoChains, weights)


def test_repeated_names_made_distinct_once():
    mod = _two_chains()
    assert duplicate_names(mod["main"]) == {"t", "u"}
    out = unique_binding_names(mod)
    assert not duplicate_names(out["main"])
    tvm.ir.assert_structural_equal(out, mod)  # only names changed
    names = [b.var.name for b in out["main"].body.blocks[0].bindings]
    assert names[:3] == ["t", "u", "r1"] and names[3:5] == ["u_u1", "t_u1"]  # the first binding keeps its name
    assert unique_binding_names(out) is out  # nothing repeats: the same module


def test_candidates_that_share_only_names_are_both_kept():
    mod = _two_chains()
    plan = decide(mod, None)
    relu = [c for c in plan.candidates if c.match.pattern == "tvmfuse.matmul_bias_relu"]
    assert [c.decision for c in relu] == [KEPT, KEPT], [c.reason for c in relu]
    fused = lower(mod, plan=plan)
    assert sorted(fused.kernel_patterns.values()) == ["tvmfuse.matmul_bias_relu"] * 2
