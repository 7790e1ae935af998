"""Decide stage: dry-run the pattern table, score each candidate with the cost model, keep the best set."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax

from tvmfuse.decide import cost_model as cm
from tvmfuse.patterns import Match, Recorder, fusion_patterns, start, stop
from tvmfuse.prepare.names import unique_binding_names

KEPT, REJECTED = "kept", "rejected"
EXACT_LIMIT = 20  # overlap groups up to this many candidates are solved exactly


@dataclass
class Settings:
    threshold_us: float = 0.0            # keep a candidate only when it saves more than this
    device: str | None = None            # a DEVICES key; default from the target
    dims: dict[str, int] = field(default_factory=lambda: {"batch": 1})  # values assumed for symbolic dims
    default_dim: int = 128
    smem_per_block: int | None = None    # override the device's shared-memory budget


@dataclass
class Candidate:
    match: Match
    unfused: cm.Cost | None = None
    fused: cm.Cost | None = None
    unfused_us: float = 0.0
    fused_us: float = 0.0
    smem: int = 0
    regs: int = 0
    decision: str = REJECTED
    reason: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.match.key

    @property
    def benefit_us(self) -> float:
        return self.unfused_us - self.fused_us

    @property
    def vars(self) -> set[str]:
        return {v.name for v, _ in self.match.bindings}

    def ops(self) -> list[str]:
        return [f"{v.name}={cm.op_name(c)}" for v, c in self.match.bindings]


@dataclass
class Plan:
    candidates: list[Candidate]
    device: cm.Device
    settings: Settings
    assumed_dims: dict[str, int]

    def chosen(self) -> set[tuple[str, str]]:
        return {c.key for c in self.candidates if c.decision == KEPT}

    def kept(self) -> list[Candidate]:
        return [c for c in self.candidates if c.decision == KEPT]


def decide(mod: tvm.IRModule, target=None, settings: Settings | None = None, patterns=None) -> Plan:
    """Every match of the table becomes a candidate with a decision and a reason; nothing is fused here."""
    settings = settings or Settings()
    mod = unique_binding_names(mod)  # candidates are known by their variables' names (lower renames alike)
    device = cm.with_budget(cm.device_for_target(target, settings.device), settings.smem_per_block)
    rec = Recorder(dry_run=True).reading(mod)
    token = start(rec)
    try:
        relax.transform.FuseOpsByPattern(fusion_patterns() if patterns is None else patterns,
                                         bind_constants=False, annotate_codegen=False)(mod)
    finally:
        stop(token)
    dims = cm.Dims(settings.dims, settings.default_dim)
    gpu = target is not None and "gpu" in target.keys
    seen, candidates = set(), []
    for match in rec.matches:
        if match.key in seen:
            continue
        seen.add(match.key)
        cand = Candidate(match)
        _score(cand, dims, device)
        if match.reason:
            cand.reason = f"check failed: {match.reason}"
        elif cand.smem > device.smem_per_block:
            cand.reason = (f"over the shared-memory budget: needs {cand.smem // 1024} KiB per block, "
                           f"{device.name} allows {device.smem_per_block // 1024} KiB")
        elif cand.regs > device.regs_per_thread:
            cand.reason = f"over the register budget: {cand.regs} per thread > {device.regs_per_thread}"
        elif gpu and _matmuls(cand) > 1 and match.pattern != "tvmfuse.attention":
            cand.reason = ("two matmuls in one kernel have no GPU schedule (dlight and tvmfuse's spaces schedule one "
                           "reduction per kernel; Llama's SwiGLU at 512x4096x11008 fp16 on the H200: 313 ms fused, "
                           "3.4 ms as two GEMMs)")
        elif cand.benefit_us <= settings.threshold_us and _reads_weight_in_place(cand):
            cand.decision = KEPT
            cand.reason = ("reads its weight [N, K] in place (the layout stage): K contiguous for the GEMV/GEMM "
                           "schedule; without the group the permute folds back into a [K, N] constant")
        elif cand.benefit_us <= settings.threshold_us:
            cand.reason = f"benefit {cand.benefit_us:.3f} us does not beat the threshold {settings.threshold_us} us"
        else:
            cand.decision = KEPT
        candidates.append(cand)
    _resolve_overlaps([c for c in candidates if c.decision == KEPT])
    candidates.sort(key=lambda c: rec.order.get(c.match.root, 0))
    return Plan(candidates, device, settings, dict(dims.used))


def _constant_permute(call) -> bool:
    """A permute_dims of a constant: the layout stage's weight read, which FoldConstant folds when not fused."""
    return cm.op_name(call) == "permute_dims" and isinstance(call.args[0], tvm.ir.GenericConst)


def _reads_weight_in_place(cand: Candidate) -> bool:
    return _matmuls(cand) == 1 and any(_constant_permute(call) for _, call in cand.match.bindings)


def _matmuls(cand: Candidate) -> int:
    return sum(cm.op_name(call) == "matmul" for _, call in cand.match.bindings)


def _score(cand: Candidate, dims: cm.Dims, device: cm.Device) -> None:
    m = cand.match
    dtype = str(getattr(m.outputs[0].ty, "dtype", "float32")) if m.outputs else "float32"
    unfused, fused, row, unfused_us = cm.Cost(), cm.Cost(launches=1), None, 0.0
    for var, call in m.bindings:
        if _constant_permute(call):  # folded at compile time when not fused: no kernel, no bytes either way
            continue
        one = cm.op_cost(call, var.ty, dims)
        unfused += one
        unfused_us += one.latency_us(device, dtype)  # each op is its own roofline
        fused.flops += cm.op_flops(call, var.ty, dims)
        if cm.op_name(call) in ("nn.layer_norm", "nn.softmax", "mean", "nn.rms_norm"):
            row = call.args[0].ty.shape[-1]
    fused.bytes_read = sum(dims.nbytes(x.ty) for x in m.inputs if isinstance(x.ty, relax.TensorType))
    fused.bytes_written = sum(dims.nbytes(v.ty) for v in m.outputs)
    cand.unfused, cand.fused = unfused, fused
    cand.unfused_us, cand.fused_us = unfused_us, fused.latency_us(device, dtype)
    shapes = {"row": row} if row is not None else {}
    if m.pattern == "tvmfuse.attention" and not m.reason:
        shapes["attention"] = m.info
    cand.smem, cand.regs = cm.resources([cm.op_name(c) for _, c in m.bindings], shapes, dims,
                                        cm._itemsize(dtype))


def _resolve_overlaps(cands: list[Candidate]) -> None:
    """Keep the non-overlapping subset with the largest total benefit, per connected group of overlaps."""
    by_var: dict[str, list[int]] = {}
    for i, c in enumerate(cands):
        for v in c.vars:
            by_var.setdefault(v, []).append(i)
    adj = [set() for _ in cands]
    for ids in by_var.values():
        for i in ids:
            adj[i].update(j for j in ids if j != i)
    done = set()
    for start_i in range(len(cands)):
        if start_i in done:
            continue
        group, todo = [], [start_i]
        while todo:
            i = todo.pop()
            if i not in done:
                done.add(i)
                group.append(i)
                todo.extend(adj[i] - done)
        if len(group) == 1:
            continue
        best = _best_set(sorted(group, key=lambda i: (-cands[i].benefit_us, -len(cands[i].vars))), adj, cands)
        total = sum(cands[i].benefit_us for i in best)
        for i in group:
            if i not in best:
                winners = [cands[j] for j in best if j in adj[i]]
                who = ", ".join(f"{w.match.pattern}@{w.match.root}" for w in winners)
                cands[i].decision = REJECTED
                cands[i].reason = (f"overlaps {who}: that choice saves {total:.3f} us in this group, "
                                   f"this candidate alone {cands[i].benefit_us:.3f} us")


def _best_set(order: list[int], adj: list[set], cands: list[Candidate]) -> set[int]:
    if len(order) > EXACT_LIMIT:  # greedy by benefit
        chosen: set[int] = set()
        for i in order:
            if not adj[i] & chosen:
                chosen.add(i)
        return chosen
    best: tuple[float, set[int]] = (-1.0, set())

    def search(k: int, chosen: set[int], total: float, remaining: float) -> None:
        nonlocal best
        if total + remaining <= best[0]:
            return
        if k == len(order):
            best = (total, set(chosen))
            return
        i = order[k]
        rest = remaining - cands[i].benefit_us
        if not adj[i] & chosen:
            chosen.add(i)
            search(k + 1, chosen, total + cands[i].benefit_us, rest)
            chosen.discard(i)
        search(k + 1, chosen, total, rest)

    search(0, set(), 0.0, sum(cands[i].benefit_us for i in order))
    return best[1]
