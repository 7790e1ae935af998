"""Launch the device kernels that wait for their predecessor (`griddepcontrol.wait`) with programmatic dependent
launch: TVM's CUDA runtime sets the attribute for the `tirx.use_programtic_dependent_launch` launch tag."""

from __future__ import annotations

import tvm
from tvm import tirx

TAG = "tirx.use_programtic_dependent_launch"  # (TVM's spelling)
_DYN_SMEM = "tirx.use_dyn_shared_memory"  # TVM's runtime wants this tag last
_LAUNCH_PARAMS = "tirx.kernel_launch_params"


def waits_for_predecessor(stmt) -> bool:
    """Whether a kernel body executes `griddepcontrol.wait` (searched through its statements, not expressions)."""
    todo = [stmt]
    while todo:
        node = todo.pop()
        if isinstance(node, tirx.Evaluate):
            call = node.value
            if (isinstance(call, tvm.ir.Call) and getattr(call.op, "name", "") == "tirx.ptx.griddepcontrol"
                    and call.args and isinstance(call.args[0], tvm.ir.StringImm) and call.args[0].value == "wait"):
                return True
        elif isinstance(node, tirx.SeqStmt):
            todo.extend(node.seq)
        else:
            for field in ("body", "then_case", "else_case"):
                child = getattr(node, field, None)
                if isinstance(child, tirx.Stmt):
                    todo.append(child)
    return False


def with_dependent_launch(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with TAG among its launch parameters (before the dynamic shared memory tag), if it waits."""
    tags = [str(t) for t in (func.attrs or {}).get(_LAUNCH_PARAMS, [])]
    if not tags or TAG in tags or not waits_for_predecessor(func.body):
        return func
    at = tags.index(_DYN_SMEM) if _DYN_SMEM in tags else len(tags)
    return func.with_attr(_LAUNCH_PARAMS, tags[:at] + [TAG] + tags[at:])


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.DependentLaunch")
def tag_dependent_launch(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Device module pass: each kernel that waits for its predecessor gets TAG."""
    out = tvm.IRModule(attrs=mod.attrs)
    for gv, func in mod.functions.items():
        out[gv] = with_dependent_launch(func) if isinstance(func, tirx.PrimFunc) else func
    return out
