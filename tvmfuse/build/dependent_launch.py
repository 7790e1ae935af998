"""Launch device kernels with programmatic dependent launch: each kernel that waits for its predecessor
(`griddepcontrol.wait`) gets the launch tag TVM's CUDA runtime sets the attribute for; with
`kernels.dependent_launch` on (the default) and a CUDA arch of sm_90 or newer, every other kernel (the generic
ones) first gets the wait, and the release of its successor, at the top of its body, so that a whole stream or
CUDA graph of kernels launches ahead."""

from __future__ import annotations

import tvm
from tvm import tirx

from tvmfuse.kernels.dependent_launch import dependent_launch
from tvmfuse.targets import cuda_arch_number

TAG = "tirx.use_programtic_dependent_launch"  # (TVM's spelling)
_DYN_SMEM = "tirx.use_dyn_shared_memory"  # TVM's runtime wants this tag last
_LAUNCH_PARAMS = "tirx.kernel_launch_params"
_GRIDDEP = "tirx.ptx.griddepcontrol"
MIN_ARCH = 90  # griddepcontrol and the launch attribute are sm_90's
#: whether the generic kernels wait at their top too (False: only the TIRx kernels that wait themselves are launched
#: dependent; `bench/models.py --before generic_waits` builds that to compare)
GENERIC_WAITS = True


def applies_to(target: tvm.target.Target | None) -> bool:
    """Whether kernels built now for `target` are launched dependent: the switch on and a CUDA arch >= MIN_ARCH."""
    number = cuda_arch_number(target) if target is not None else None
    return dependent_launch() and number is not None and number >= MIN_ARCH


def _griddep_actions(stmt) -> set[str]:
    """The `griddepcontrol` actions a kernel body executes (searched through its statements, not expressions)."""
    found, todo = set(), [stmt]
    while todo:
        node = todo.pop()
        if isinstance(node, tirx.Evaluate):
            call = node.value
            if (isinstance(call, tvm.ir.Call) and getattr(call.op, "name", "") == _GRIDDEP and call.args
                    and isinstance(call.args[0], tvm.ir.StringImm)):
                found.add(call.args[0].value)
        elif isinstance(node, tirx.SeqStmt):
            todo.extend(node.seq)
        else:
            for field in ("body", "then_case", "else_case"):
                child = getattr(node, field, None)
                if isinstance(child, tirx.Stmt):
                    todo.append(child)
    return found


def _griddep(action: str) -> tirx.Evaluate:
    return tirx.Evaluate(tirx.call_intrin("void", _GRIDDEP, tvm.ir.StringImm(action), tvm.ir.StringImm("")))


def with_dependent_launch(func: tirx.PrimFunc, wait_first: bool = False) -> tirx.PrimFunc:
    """`func` with TAG among its launch parameters (before the dynamic shared memory tag), if it waits; with
    `wait_first`, a kernel that has no `griddepcontrol` at all first waits and releases at the top of its body."""
    tags = [str(t) for t in (func.attrs or {}).get(_LAUNCH_PARAMS, [])]
    if not tags or TAG in tags:
        return func
    actions = _griddep_actions(func.body)
    if wait_first and not actions:
        func = func.with_body(tirx.SeqStmt([_griddep("wait"), _griddep("launch_dependents"), func.body]))
    elif "wait" not in actions:
        return func
    at = tags.index(_DYN_SMEM) if _DYN_SMEM in tags else len(tags)
    return func.with_attr(_LAUNCH_PARAMS, tags[:at] + [TAG] + tags[at:])


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.DependentLaunch")
def tag_dependent_launch(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Device module pass: each kernel that waits for its predecessor gets TAG; where `applies_to` its target, every
    kernel waits (at its top, where it did not already) and gets it."""
    out = tvm.IRModule(attrs=mod.attrs)
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            every = GENERIC_WAITS and applies_to((func.attrs or {}).get("target"))
            func = with_dependent_launch(func, wait_first=every)
        out[gv] = func
    return out
