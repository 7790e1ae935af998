"""How bench/models.py runs and times each contender: the product's export and TVM builds in a Relax VM (with an
optional per-kernel profile), torch eager and torch.compile; every output checked against the fp32 reference."""

from __future__ import annotations

import itertools
import time

import numpy as np


def time_torch(fn, cuda: bool) -> float:
    """Median us per call: bench.run's CUDA-event timer on the GPU (iterations sized to ~50 ms), wall clock on CPU."""
    if cuda:
        from bench.run import t_events
        one = t_events(fn, iters=1, reps=3)
        return t_events(fn, iters=int(min(50, max(3, 5e4 / max(one, 1.0)))), reps=5)
    fn()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    return float(np.median(ts))


def time_vm(vm, dev, args) -> float:
    vm["main"](*args)  # warm (a CUDA-graph build captures here)
    dev.sync()
    timer = vm.time_evaluator("main", dev, number=1, repeat=5, min_repeat_ms=100)
    return float(np.median(timer(*args).results) * 1e6)


def load_vm(path: str, dev):
    import tvm
    from tvm import relax
    return relax.VirtualMachine(tvm.runtime.load_module(path), dev)


def measure_vm(vm, dtypes: list[str], ctx: dict) -> dict:
    """Run a Relax VM on the case's inputs (as device tensors in the dtypes `main` takes); time it; check it."""
    import tvm
    from tvmfuse.export.runtime import to_numpy
    dev = ctx["dev"]
    from tvmfuse.verify.outputs import cast_array
    args = [tvm.runtime.tensor(cast_array(a, d), dev) for a, d in zip(ctx["feeds"].values(), dtypes)]
    outs = to_numpy(vm["main"](*args))
    io = {"float_inputs": sorted({d for d in dtypes if "float" in d}), "outputs": sorted({str(o.dtype) for o in outs})}
    row = _measured(outs, time_vm(vm, dev, args), io, ctx)
    if ctx.get("profile"):
        row["kernels_profile"] = kernel_profile(vm, dev, args)
        if ctx["cuda"]:
            row["gpu_kernels"] = gpu_kernels(lambda: vm["main"](*args))
    return row


def gpu_kernels(fn, calls: int = 10, top: int = 16, name_chars: int = 120) -> dict:
    """The device's own record of what `fn` ran (CUPTI through torch.profiler; sees TVM's launches and the
    kernels inside CUDA graphs): per kernel name, launches and microseconds per call, and the sum against the
    busy span (first start to last end per call), whose difference is the idle time between kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    return kernel_summary(prof, calls, top, name_chars)


def kernel_summary(prof, calls: int, top: int = 16, name_chars: int = 120, gaps: int = 6,
                   synced: bool = True, timeline: bool = False, marker: str | None = None) -> dict:
    """`gpu_kernels`' summary of a finished torch.profiler run that made `calls` calls: per kernel name, launches and
    microseconds per call; the busy time (kernel time summed) against the span of one call (its first start to its
    last end), whose difference is the device's idle time inside a call; and the largest idle gaps inside a call,
    each named by the kernels either side (a CUDA graph's kernels run back to back unless something holds one).
    `synced=False`: calls queued back to back (no host sync between them), measured as one run shared out. Each
    kernel's `exposed_us` (and their sum) is its duration less the time it overlapped kernels started before it
    (`exposed_time`): the measure of a kernel under dependent launch. `timeline`: also one call's events in order
    (`call_timeline`); `marker`: see `summarise_kernels`."""
    from torch.autograd import DeviceType
    evs = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return summarise_kernels(evs, calls, top, name_chars, gaps, synced, timeline, marker)


def summarise_kernels(evs: list[tuple[str, float, float]], calls: int, top: int = 16, name_chars: int = 120,
                      gaps: int = 6, synced: bool = True, timeline: bool = False, marker: str | None = None) -> dict:
    """`kernel_summary` of (name, start us, end us) device events. Synced calls are told apart by count where each
    ran as many kernels, else by the `calls - 1` longest pauses (the host's syncs between calls: a call whose host
    pauses between its own launches can be cut wrongly); the others are one run, shared out. `timeline`: the
    second call's share of the events in order (`call_timeline`). `marker`: a kernel each call ends with, where the
    recording may start inside a call: the events up to its first launch are dropped, and the calls are counted by
    it (the timeline is then the first whole call)."""
    if marker is not None:
        evs = sorted(evs, key=lambda e: e[1])
        first = next((i for i, e in enumerate(evs) if marker in e[0]), len(evs))
        evs = evs[first + 1:]
        calls = max(sum(marker in e[0] for e in evs), 1)
    agg: dict[str, list] = {}
    for name, start, end in evs:
        a = agg.setdefault(name, [0, 0.0])
        a[0], a[1] = a[0] + 1, a[1] + (end - start)
    busy = sum(a[1] for a in agg.values()) / calls
    ranked = sorted(agg.items(), key=lambda kv: -kv[1][1])
    out = {"kernels_per_call": round(sum(a[0] for a in agg.values()) / calls, 1), "busy_us": round(busy, 1)}
    order = sorted(evs, key=lambda e: e[1])
    ends = list(itertools.accumulate((e[2] for e in order), max))
    pauses = [(order[i + 1][1] - ends[i], i + 1) for i in range(len(order) - 1)]
    if not synced:
        cuts = []
    elif len(order) % calls == 0:  # every call ran the same kernels: the calls are consecutive runs of that many
        cuts = list(range(len(order) // calls, len(order), len(order) // calls))
    else:
        cuts = sorted(i for _, i in sorted(pauses, reverse=True)[:max(calls - 1, 0)])
    groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)]) if b > a]
    share = len(groups) if synced else calls
    if groups:
        out["span_us"] = round(sum(max(e[2] for e in g) - g[0][1] for g in groups) / share, 1)
        held: dict[tuple[str, str], float] = {}
        for g in groups:
            for name, _, _, _, idle, before in sweep(g):
                if idle > 0:
                    key = (before[:name_chars], name[:name_chars])
                    held[key] = held.get(key, 0.0) + idle
        # the time no kernel ran (span less busy is not it where kernels overlap: under dependent launch a kernel's
        # duration counts its wait, so busy exceeds the span while gaps remain between kernels)
        out["idle_in_call_us"] = round(sum(held.values()) / share, 1)
        out["gaps"] = [{"after": a, "before": b, "us": round(us / share, 2)}
                       for (a, b), us in sorted(held.items(), key=lambda kv: -kv[1])[:gaps]]
    exposed = exposed_time(order)
    out["exposed_us"] = round(sum(exposed.values()) / calls, 1)
    out["top"] = [{"name": k[:name_chars], "per_call": round(v[0] / calls, 1), "us": round(v[1] / calls, 1),
                   "exposed_us": round(exposed[k] / calls, 1)} for k, v in ranked[:top]]
    if timeline:
        marks = [i for i, e in enumerate(order) if marker is not None and marker in e[0]]
        per_call = len(order) // calls
        out["timeline"] = call_timeline(order[:marks[0] + 1] if marks
                                        else order[per_call:2 * per_call] if calls > 1 else order)
    return out


def sweep(order: list[tuple[str, float, float]]):
    """Each event (in start order) as (name, start, end, exposed, idle, before): the time it ran past every event
    that started before it, the time nothing ran before it started, and the name of the event whose end it
    follows ("" for the first)."""
    last_end, last_name = None, ""
    for name, start, end in order:
        exposed = end - start if last_end is None else max(0.0, end - max(start, last_end))
        idle = 0.0 if last_end is None else max(0.0, start - last_end)
        yield name, start, end, exposed, idle, last_name
        if last_end is None or end >= last_end:
            last_end, last_name = end, name


def call_timeline(events: list[tuple[str, float, float]], name_chars: int = 64) -> list[list]:
    """Events in start order as [name, start (µs after the first), duration, exposed (`exposed_time` of that
    launch alone), idle before it]: where a call's time goes, launch by launch."""
    return [[name[:name_chars], round(start - events[0][1], 2), round(end - start, 2), round(exposed, 2),
             round(idle, 2)] for name, start, end, exposed, idle, _ in sweep(events)]


def exposed_time(order: list[tuple[str, float, float]]) -> dict[str, float]:
    """Per kernel name, the time its launches ran past every kernel that started before them (events in start
    order): with programmatic dependent launch a kernel starts while its predecessor runs and waits for it, so its
    duration (`us`) counts that wait and the kernels' durations add up to more than the span; their exposed times
    add up to the span less the idle time, each the time that kernel adds to a call."""
    exposed: dict[str, float] = {}
    for name, _, _, time_past, _, _ in sweep(order):
        exposed[name] = exposed.get(name, 0.0) + time_past
    return exposed


def kernel_profile(vm, dev, args, top: int = 8) -> dict:
    """One instrumented call: each called function's time (device synced around it; launch overhead included)
    and the first calls whose arguments hold a non-finite value after they ran (where an inf/nan appears)."""
    import tvm
    times: dict[str, list] = {}
    bad: list[str] = []
    start = [0.0]

    def instrument(_func, name, before, _ret, *fargs):
        dev.sync()
        if before:
            start[0] = time.perf_counter()
            return
        n_us = times.setdefault(name, [0, 0.0])
        n_us[0], n_us[1] = n_us[0] + 1, n_us[1] + (time.perf_counter() - start[0]) * 1e6
        if len(bad) < 4:
            for a in fargs:
                if isinstance(a, tvm.runtime.Tensor) and "float" in str(a.dtype) and not np.isfinite(
                        a.numpy().astype("float32")).all():
                    bad.append(name)
                    break

    vm.set_instrument(instrument)
    try:
        vm["main"](*args)
    finally:
        vm.set_instrument(lambda *_: None)
    ranked = sorted(times.items(), key=lambda kv: -kv[1][1])
    return {"total_us": round(sum(v[1] for v in times.values()), 1),
            "top": [{"name": k, "calls": v[0], "us": round(v[1], 1)} for k, v in ranked[:top]],
            "nonfinite_args_after": bad}


def run_tvm(ctx: dict, key: str) -> dict:
    """A contender built by bench/model_builds.py: load its library (or the product's export) and measure it."""
    import tvmfuse
    built = ctx["info"][key]
    t = time.time()
    vm = tvmfuse.load(built["export"], ctx["dev"]).vm if "export" in built else load_vm(built["library"], ctx["dev"])
    load_s = round(time.time() - t, 1)  # includes compiling the CUDA source (TVM_CUDA_COMPILE_MODE)
    info = {k: v for k, v in built.items() if k not in ("library", "main_dtypes")}
    return dict(info, contender=key, load_s=load_s, **measure_vm(vm, built["main_dtypes"], ctx))


def run_torch(ctx: dict, mode: str | None) -> dict:
    import torch
    fn, info = ctx["torch_low"], {}
    if mode is not None:
        torch._dynamo.reset()  # pylint: disable=protected-access
        fn = torch.compile(fn, mode=mode)
        t = time.time()
        fn(*ctx["torch_in"])
        fn(*ctx["torch_in"])
        info["compile_s"] = round(time.time() - t, 1)
    outs = fn(*ctx["torch_in"])
    outs = [o.detach().float().cpu().numpy() for o in (outs if isinstance(outs, tuple) else (outs,))]
    us = time_torch(lambda: fn(*ctx["torch_in"]), ctx["cuda"])
    if ctx.get("profile") and ctx["cuda"]:
        info["gpu_kernels"] = gpu_kernels(lambda: fn(*ctx["torch_in"]))
    name = "torch_eager" if mode is None else "torch_compile" + ("_reduce_overhead" if mode == "reduce-overhead" else "")
    return dict(info, contender=name, mode=mode or "eager",
                **_measured(outs, us, {"dtype": str(ctx["torch_dtype"]).replace("torch.", "")}, ctx))


def _measured(outs, us, io, ctx) -> dict:
    from tvmfuse.verify.outputs import compare
    check = compare([np.asarray(o, np.float32) for o in outs], ctx["ref"], compute_dtype=ctx["dtype"])
    # the error's spread besides its max (a max over 10^5 noisy elements moves with one tail): rms, and how many
    # elements miss the tolerance (bench/fp16_error.py emulates the fp16 policy with the same two figures)
    return {"us": us, "max_abs_err": check.max_abs_err, "max_rel_err": check.max_rel_err, "within_tol": check.ok,
            "rms_err": check.rms_err, "violations": check.violations, "io": io}
