"""GPU benchmark of the attention templates vs torch SDPA (and TVM's generic path) at the issue's shapes."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.environ.get("TVMFUSE_BENCH_WORK", "/tmp/tvmfuse_attention_bench")  # the wgmma variants' libraries
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

CASES = [  # name, template, shapes, knob filter
    ("prefill_b1_h32_s2048_d128_causal_fp16", "prefill", dict(batch=1, heads=32, kv_heads=32, seq_q=2048, seq_k=2048, head_dim=128, dtype="float16", causal=True)),
    ("prefill_b1_h32_s2048_d128_causal_bf16", "prefill", dict(batch=1, heads=32, kv_heads=32, seq_q=2048, seq_k=2048, head_dim=128, dtype="bfloat16", causal=True)),
    ("prefill_b1_h32kv8_s2048_d64_mask_fp16", "prefill", dict(batch=1, heads=32, kv_heads=8, seq_q=2048, seq_k=2048, head_dim=64, dtype="float16", mask="additive", mask_shape=(1, 1, 2048, 2048))),
    ("decode_b1_h32kv8_L4096_d128_fp16", "decode", dict(batch=1, heads=32, kv_heads=8, seq_q=1, seq_k=4096, head_dim=128, dtype="float16")),
    ("decode_b16_h32kv8_L4096_d128_fp16", "decode", dict(batch=16, heads=32, kv_heads=8, seq_q=1, seq_k=4096, head_dim=128, dtype="float16")),
    # the in-place KV cache's layout (positions first: [capacity, batch, kv heads, head dim], read where it lies)
    # against heads first, at Llama-2-7B's 32 KV heads: generate_run2's long-cache decode read its cache at ~0.4 TB/s
    ("decode_b1_h32_L2048_d128_fp16", "decode", dict(batch=1, heads=32, kv_heads=32, seq_q=1, seq_k=2048, head_dim=128, dtype="float16")),
    ("decode_b1_h32_L2048_d128_fp16_sbhd", "decode", dict(batch=1, heads=32, kv_heads=32, seq_q=1, seq_k=2048, head_dim=128, dtype="float16", k_layout="SBHD", v_layout="SBHD")),
    ("decode_b16_h32_L2048_d128_fp16", "decode", dict(batch=16, heads=32, kv_heads=32, seq_q=1, seq_k=2048, head_dim=128, dtype="float16")),
    ("decode_b16_h32_L2048_d128_fp16_sbhd", "decode", dict(batch=16, heads=32, kv_heads=32, seq_q=1, seq_k=2048, head_dim=128, dtype="float16", k_layout="SBHD", v_layout="SBHD")),
    # the decode step's kernel as a decoder export has it (generate_run3: 2x these above in the model): a symbolic KV
    # length (one kernel for every step: "length" is the one measured), the fp32 additive mask [B, 1, 1, L]
    *[(f"decode_b{b}_h32_L2048_d128_fp16_sbhd{tag}", "decode",
       dict(batch=b, heads=32, kv_heads=32, seq_q=1, seq_k="past + 1" if sym else 2048, head_dim=128, dtype="float16",
            k_layout="SBHD", v_layout="SBHD", length=2048,
            **(dict(mask="additive", mask_shape=(b, 1, 1, "past + 1" if sym else 2048), mask_dtype="float32")
               if mask else {})))
      for b in (1, 16) for tag, sym, mask in (("_mask32", False, True), ("_symL", True, False),
                                              ("_symL_mask32", True, True))],
]
# the Hopper template (attention_prefill_wgmma, sm_90a) at issue 25's shapes: causal and not, 2048 and 8192 tokens,
# 32 heads of 128 and a GQA case with 8 KV heads, fp16 and bf16; the mma.sync template at 2048 beside it
WGMMA_CASES = [
    (f"prefill_wgmma_b1_h32{'kv8' if kv == 8 else ''}_s{n}_d128{'_causal' if causal else ''}_{tag}", "prefill_wgmma",
     dict(batch=1, heads=32, kv_heads=kv, seq_q=n, seq_k=n, head_dim=128, dtype=dt, causal=causal))
    for dt, tag in (("float16", "fp16"), ("bfloat16", "bf16")) for n in (2048, 8192) for causal in (True, False)
    for kv in (32, 8) if kv == 32 or (causal and n == 8192)]
CASES += WGMMA_CASES
# what one CTA costs besides its key tiles (`--only keys_wgmma`): 2048 queries against 128 ... 2048 keys, not causal,
# the same 512 CTAs each time; a line through the times gives the per-CTA cost (its intercept) for tvmfuse and cuDNN
KEYS_SWEEP = [(f"keys_wgmma_b1_h32_q2048_k{n}_d128_fp16", "prefill_wgmma",
               dict(batch=1, heads=32, kv_heads=32, seq_q=2048, seq_k=n, head_dim=128, dtype="float16", causal=False))
              for n in (128, 256, 512, 1024, 2048)]
CASES += KEYS_SWEEP
# the shapes the models of bench/models.py give the template (`--only model_wgmma`): GPT-2's 12 heads of 64 and one
# Llama-2-7B layer's 32 of 128, causal, batch 1, at prefill 512 and 2048: grids of 48 to 512 CTAs, where the knob
# sets measured at 32 heads of 128 (and head dim 64 not at all) may not be the best
MODEL_CASES = [(f"model_wgmma_{m}_b1_h{h}_s{n}_d{d}_causal_fp16", "prefill_wgmma",
                dict(batch=1, heads=h, kv_heads=h, seq_q=n, seq_k=n, head_dim=d, dtype="float16", causal=True))
               for m, h, d in (("gpt2", 12, 64), ("llama", 32, 128)) for n in (512, 2048)]
CASES += MODEL_CASES
DECODE_SPLITS = {1: (16, 32), 16: (4, 8)}  # the decode knob sets measured: every warps/unroll at these splits
LIKE = {"prefill_b1_h32_s2048_d128_causal_bf16": "prefill_b1_h32_s2048_d128_causal_fp16"}  # measure its 6 best
LIKE.update({name: name.replace("_bf16", "_fp16") for name, _, _ in WGMMA_CASES if name.endswith("_bf16")})


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def torch_time(fn, iters=50):
    import torch
    fn(); torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            fn()
        end.record(); torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(times)[len(times) // 2]


def torch_side(s, tensors, res):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v, m = tensors
    kw = dict(attn_mask=m, is_causal=s.get("causal", False), enable_gqa=s["heads"] != s["kv_heads"])
    call = lambda: F.scaled_dot_product_attention(q, k, v, **kw)  # noqa: E731
    try:
        choice = torch._fused_sdp_choice(q, k, v, attn_mask=m, dropout_p=0.0, is_causal=kw["is_causal"],
                                         enable_gqa=kw["enable_gqa"])
        res["torch_choice"] = SDPBackend(choice).name
    except Exception as err:  # noqa: BLE001
        res["torch_choice"] = f"unknown ({type(err).__name__})"
    res["torch_us"] = torch_time(call)
    res["torch_backends_us"] = {}
    for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([b]):
                res["torch_backends_us"][b.name] = torch_time(call, 20)
        except Exception as err:  # noqa: BLE001
            res["torch_backends_us"][b.name] = f"failed: {str(err).splitlines()[0][:120]}"
    return call().float()


def build_all(fns, target):
    """Build every variant at once with the tuning builder (tvmfuse.tune: MetaSchedule's LocalBuilder, one
    worker per core, the same fast_build): [(artifact path or None, error or None)]."""
    import tvm
    from tvm.s_tir import meta_schedule as ms
    from tvmfuse.tune.search import make_builder as _builder
    built = _builder(os.cpu_count() or 1).build([ms.builder.BuilderInput(tvm.IRModule({"main": f}), target) for f in fns])
    return [(r.artifact_path, r.error_msg) for r in built]


def build_tirx(fns, target, folder):
    """Build TIRx variants (tvm.compile's tirx pipeline; nvcc runs in parallel threads), each exported to a library
    in `folder`: [(path or None, error or None)]."""
    from concurrent.futures import ThreadPoolExecutor

    import tvm

    def one(i_fn):
        i, fn = i_fn
        try:
            path = os.path.join(folder, f"variant_{i}.so")
            if os.path.exists(path):  # built by this case's earlier child (restarted after a hung knob set)
                return path, None
            tvm.compile(tvm.IRModule({"main": fn}), target=target, tir_pipeline="tirx").export_library(path)
            return path, None
        except Exception as err:  # noqa: BLE001
            return None, f"{type(err).__name__}: {str(err)[-600:]}"
    os.makedirs(folder, exist_ok=True)
    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        return list(pool.map(one, enumerate(fns)))


def tvm_run(artifact, tensors, out, dev):
    """Load a built variant, run it on torch tensors (shared through DLPack), time it with TVM's evaluator."""
    import tvm
    lib = tvm.runtime.load_module(artifact)
    args = [tvm.runtime.from_dlpack(t) for t in tensors] + [tvm.runtime.from_dlpack(out)]
    lib["main"](*args)
    dev.sync()
    t = lib.time_evaluator("main", dev, number=50, repeat=5, min_repeat_ms=50)(*args)
    return sorted(t.results)[len(t.results) // 2] * 1e6


def generic_path(s, tensors, dev, target):
    """TVM's stock path: the same attention graph as Relax ops, default GPU pipeline (FuseOps + dlight)."""
    import tvm
    from tvm import relax
    bb, dt, g = relax.BlockBuilder(), s["dtype"], s["heads"] // s["kv_heads"]
    params = [relax.Var(n, relax.TensorType(tuple(a.shape), dt)) for n, a in zip("qkvm", tensors)]
    with bb.function("main", params):
        with bb.dataflow():
            k, v = params[1], params[2]
            if g > 1:
                k, v = (bb.emit(relax.op.repeat(x, g, axis=1)) for x in (k, v))
            sc = bb.emit(relax.op.matmul(params[0], bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
            sc = bb.emit(relax.op.multiply(sc, relax.const(1 / math.sqrt(s["head_dim"]), dt)))
            if len(params) == 4:
                sc = bb.emit(relax.op.add(sc, params[3]))
            o = bb.emit_output(relax.op.matmul(bb.emit(relax.op.nn.softmax(sc, axis=-1)), v))
        bb.emit_func_output(o)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target=target), dev)
    args = [tvm.runtime.from_dlpack(t) for t in tensors]
    vm.set_input("main", *args)
    t = vm.time_evaluator("invoke_stateful", dev, number=20, repeat=3)("main")
    return sorted(t.results)[1] * 1e6


def _cuda_broken() -> bool:
    """Whether a sticky CUDA error (an illegal address, a trap) has broken this process's context."""
    import torch
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").item()
        return False
    except Exception:  # noqa: BLE001
        return True


def knob_filter(text: str, flag: str = "--knobs") -> dict:
    """--knobs (or --with) "consumers=2,setmaxnreg=1" -> {"consumers": 2, "setmaxnreg": 1}; a bad item is an error."""
    out = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip().lstrip("-").isdigit():
            raise SystemExit(f"error: {flag} wants NAME=INT items separated by commas, got {item!r}")
        out[key.strip()] = int(value)
    return out


def with_outside_knobs(knob_list: list[dict], extras: list[dict], build) -> tuple[list[dict], list]:
    """(the sets, their kernels): `knob_list`, then each of its sets again with each group of knobs outside the space
    (`--with`), where `build` takes it (a ValueError: the kernel refuses that combination, it is left out) and gives a
    kernel of its own (a group that changes nothing for a set, as tail=0 where no tile is ragged, is not timed
    twice)."""
    from tvm_ffi import structural_hash  # pylint: disable=import-outside-toplevel

    def body_hash(func):  # the kernel without its attrs (they name the knobs)
        return structural_hash(func.body, map_free_vars=True)

    sets, funcs = list(knob_list), [build(kn) for kn in knob_list]
    seen = {body_hash(f) for f in funcs}
    for extra in extras:
        for kn in knob_list:
            try:
                func = build(dict(kn, **extra))
            except ValueError:
                continue
            key = body_hash(func)
            if key not in seen:
                seen.add(key)
                sets.append(dict(kn, **extra))
                funcs.append(func)
    return sets, funcs


def run_case(name, kind, s, dev, target, res, generic, report=None, save=lambda: None, only_knobs=None, ablate=(),
             extra_knobs=None):
    import torch
    from tvmfuse.kernels import ATTENTION_DECODE, ATTENTION_PREFILL, ATTENTION_PREFILL_WGMMA
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target
    tmpl = {"prefill": ATTENTION_PREFILL, "prefill_wgmma": ATTENTION_PREFILL_WGMMA}.get(kind, ATTENTION_DECODE)
    if kind == "prefill_wgmma":
        s, target = dict(s, arch="sm_90a"), hopper_target()
    res.update(shapes={k: v for k, v in s.items()}, template=tmpl.name)
    reason = tmpl.check(s)
    if reason:
        raise ValueError(reason)
    tdt = getattr(torch, s["dtype"])
    B, H, HKV, SQ, L, D = (s[k] for k in ("batch", "heads", "kv_heads", "seq_q", "seq_k", "head_dim"))
    L = s.get("length", L) if isinstance(L, str) else L  # a symbolic KV length: the one measured
    torch.manual_seed(0)
    q, k, v = (torch.randn(sh, device="cuda", dtype=tdt) for sh in ((B, H, SQ, D), (B, HKV, L, D), (B, HKV, L, D)))
    mask_shape = tuple(L if isinstance(x, str) else x for x in s.get("mask_shape", ()))
    m = (torch.randn(mask_shape, device="cuda") * 2).to(getattr(torch, s.get("mask_dtype", s["dtype"]))) \
        if s.get("mask") == "additive" else None
    ref = torch_side(s, (q, k, v, m.to(tdt) if m is not None else None), res)
    save()  # a heartbeat for the supervisor between the phases
    stored = {"SBHD": lambda t: t.permute(2, 0, 1, 3)}  # K/V as the template reads them (BHSD: as they are)
    k_in, v_in = (stored.get(s.get(f"{x}_layout", "BHSD"), lambda t: t)(t) for x, t in (("k", k), ("v", v)))
    tensors = [t.contiguous() for t in (q, k_in, v_in) + ((m,) if m is not None else ())]
    flops = 4 * B * H * SQ * L * D / (2 if s.get("causal") else 1)
    bytes_ = 2 * (q.numel() + k.numel() + v.numel() + q.numel())
    knob_list = [kn for kn in tmpl.knob_space(s)
                 if all(kn.get(key, value) == value for key, value in (only_knobs or {}).items())]
    like = (report or {}).get("cases", {}).get(LIKE.get(name), {}).get("trials")
    if like:  # the same kernel in another dtype: its fastest correct knob sets only
        knob_list = [t["knobs"] for t in sorted((t for t in like if t.get("ok")), key=lambda t: t["us"])[:6]] or knob_list
    if kind == "decode":
        res["default_knobs"] = tmpl.default_knobs(s)  # the product's pick, always measured
        knob_list = [kn for kn in knob_list if kn["split"] in DECODE_SPLITS.get(B, ())]
        knob_list += [res["default_knobs"]] if res["default_knobs"] not in knob_list else []
    t0 = time.time()
    res["building"] = True
    save()  # the supervisor gives a building child BUILD_S, not HANG_S
    if kind == "prefill_wgmma":
        res["default_knobs"] = tmpl.default_knobs(s)  # the product's pick, measured first
        knob_list = [res["default_knobs"]] + [kn for kn in knob_list if kn != res["default_knobs"]]
        knob_list, funcs = with_outside_knobs(knob_list, extra_knobs or [], lambda kn: tmpl(s, kn))
        knob_list += [dict(kn, ablate=a) for a in ablate for kn in knob_list]  # timed only: their output is wrong
        funcs += [tmpl(s, kn) for kn in knob_list[len(funcs):]]
        built = build_tirx(funcs, target, os.path.join(WORK, name))
    else:
        built = build_all([tmpl(s, kn) for kn in knob_list], target)
    res.pop("building")
    res["build_seconds"] = round(time.time() - t0, 1)
    log(f"  built {len(knob_list)} variants in {res['build_seconds']} s")
    before = res.get("trials", [])  # an earlier child's trials of this case (it hung or crashed)
    res["trials"] = []
    save()
    for i, (kn, (artifact, error)) in enumerate(zip(knob_list, built)):
        trial = dict(before[i]) if i < len(before) and before[i]["knobs"] == kn else {"knobs": kn}
        res["trials"].append(trial)
        if trial.pop("running", False):
            trial["error"] = "hung or crashed: the child measuring it ended without a result"
        if "us" in trial or "error" in trial:
            continue
        trial["running"] = True
        save()  # a child that dies now leaves this trial marked running, and the next child records it
        try:
            if error:
                raise RuntimeError(f"build failed: {error}")
            t0 = time.time()
            out = torch.full((B, H, SQ, D), float("nan"), device="cuda", dtype=tdt)
            us = tvm_run(artifact, tensors, out, dev)
            got = out.float()
            err = (got - ref).abs().max().item()
            trial.update(us=us, max_abs_err=err, ok=bool(err < 3e-2) and not kn.get("ablate"),
                         seconds=round(time.time() - t0, 1))
            log(f"  {name} {kn}: {us:.1f} us, err {err:.2e}")
        except Exception as e:  # noqa: BLE001
            trial["error"] = f"{type(e).__name__}: {str(e)[-800:]}"
            log(f"  {name} {kn}: FAILED {trial['error'][:200]}")
        trial.pop("running")
        save()
        if "error" in trial and _cuda_broken():
            log("  the CUDA context is broken: this child ends, the next goes on after this knob set")
            os._exit(3)
    good = [t for t in res["trials"] if t.get("ok")]
    if good:
        best = min(good, key=lambda t: t["us"])
        res.update(best_knobs=best["knobs"], tvmfuse_us=best["us"], speedup_vs_torch=res["torch_us"] / best["us"])
        prefill = kind.startswith("prefill")
        res["tvmfuse_tflops" if prefill else "tvmfuse_TBps"] = (flops if prefill else bytes_) / best["us"] / 1e6
    prefill = kind.startswith("prefill")
    res["torch_tflops" if prefill else "torch_TBps"] = (flops if prefill else bytes_) / res["torch_us"] / 1e6
    if generic:
        try:
            res["tvm_generic_us"] = generic_path(s, tensors, dev, target)
        except Exception as e:  # noqa: BLE001
            res["tvm_generic_error"] = f"{type(e).__name__}: {str(e)[-400:]}"


def print_table(report) -> None:
    """One line a case: the best correct knob set against torch's choice and cuDNN, and how the others ended."""
    print(f"{'case':48} {'tvmfuse us':>10} {'TFLOP/s':>7} {'torch us':>9} {'cuDNN us':>9} {'vs cuDNN':>8}  ok/wrong/failed")
    for name, r in report["cases"].items():
        trials = [t for t in r.get("trials", []) if not t["knobs"].get("ablate")]
        ok = sum(bool(t.get("ok")) for t in trials)
        wrong = sum("us" in t and not t.get("ok") for t in trials)
        cudnn = r.get("torch_backends_us", {}).get("CUDNN_ATTENTION")
        cudnn = cudnn if isinstance(cudnn, float) else None
        us = r.get("tvmfuse_us")
        print(f"{name:48} {us or float('nan'):10.1f} {r.get('tvmfuse_tflops', float('nan')):7.0f} "
              f"{r.get('torch_us', float('nan')):9.1f} {cudnn or float('nan'):9.1f} "
              f"{(cudnn / us) if us and cudnn else float('nan'):8.2f}  {ok}/{wrong}/{len(trials) - ok - wrong}"
              + (f"  error: {r['error'].strip().splitlines()[-1][:80]}" if r.get("error") else ""))
    for who, f in report.get("keys_sweep_fit", {}).items():
        print(f"keys sweep, {who}: {f['intercept_us']:.1f} us without key tiles + {f['us_per_128_keys']:.1f} us "
              f"per 128 keys ({len(f['points'])} points)")


def fixed_cost_fit(report) -> dict:
    """The keys sweep's times as intercept + slope x keys (least squares), for tvmfuse's best set and cuDNN: the
    intercept is what the 512 CTAs cost without key tiles, over their waves on the GPU."""
    points = {"tvmfuse": [], "cudnn": []}
    for name, _, s in KEYS_SWEEP:
        r = report["cases"].get(name, {})
        cudnn = r.get("torch_backends_us", {}).get("CUDNN_ATTENTION")
        for who, us in (("tvmfuse", r.get("tvmfuse_us")), ("cudnn", cudnn if isinstance(cudnn, float) else None)):
            if us:
                points[who].append((s["seq_k"], us))
    fit = {}
    for who, pts in points.items():
        if len(pts) >= 2:
            slope, intercept = np.polyfit([x for x, _ in pts], [y for _, y in pts], 1)
            fit[who] = {"intercept_us": float(intercept), "us_per_128_keys": float(slope) * 128, "points": pts}
    return fit


HANG_S = 30  # a child whose report has not moved for this long is measuring a hung kernel: killed, and restarted
BUILD_S = 900  # while a child builds (CPU only, it cannot hang on the GPU) it may go this long without a report


def child_is_hung(report_mtime: float, child_started: float, building: bool, now: float) -> bool:
    """A child is hung when neither it nor its report has moved for HANG_S (BUILD_S while it builds); the clock
    starts at the child's own start, so a child that follows a killed one gets its full time."""
    return now - max(report_mtime, child_started) > (BUILD_S if building else HANG_S)


def supervise(args, name) -> None:
    """Measure one case in child processes: one whose report stops moving for HANG_S (a kernel waiting on an
    mbarrier phase that never comes) is killed, as is the kernel, and a new child goes on after that knob set,
    recording it as hung; a child that ends on a sticky CUDA error is followed the same way."""
    import signal
    import subprocess
    cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--case", name, "--knobs", args.knobs,
           "--ablate", args.ablate, "--with", args.extra] + \
        (["--no-generic"] if args.no_generic else [])
    for attempt in range(60):
        child, started = subprocess.Popen(cmd, start_new_session=True), time.time()
        while child.poll() is None:
            time.sleep(2)
            mtime = os.path.getmtime(args.out)
            try:
                with open(args.out) as fh:
                    building = json.load(fh)["cases"].get(name, {}).get("building", False)
            except (OSError, ValueError, KeyError):  # read while the child replaced it: judge by the time alone
                building = False
            if child_is_hung(mtime, started, building, time.time()):
                log(f"  no progress for {BUILD_S if building else HANG_S} s: killing the child (a hung kernel)")
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        with open(args.out) as fh:
            if "seconds" in json.load(fh)["cases"].get(name, {}):
                return
        log(f"  child ended ({child.returncode}) before the case finished: restarting after its last knob set")
    log("  gave up after 60 children")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--no-generic", action="store_true")
    ap.add_argument("--ablate", default="", help="comma-separated parts the prefill_wgmma kernel leaves out "
                    "(softmax, pv): each knob set measured again without each, to time what the part costs")
    ap.add_argument("--with", dest="extra", default="", help="NAME=INT,...[;NAME=INT,...]: each measured set also "
                    "with these knob values outside the knob space (e.g. 'persistent=1;persistent=1,chain=1': each "
                    "set with each group), where the kernel takes them")
    ap.add_argument("--knobs", default="", help="NAME=INT,...: only the knob sets with these values (and the "
                    "default set), e.g. consumers=2,setmaxnreg=1")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # a child: measure this case into --out's report
    args = ap.parse_args()
    try:
        only_knobs = knob_filter(args.knobs)
        extra_knobs = [knob_filter(part, "--with") for part in args.extra.split(";") if part.strip()]
    except SystemExit as e:  # one error line, exit 2
        print(e, file=sys.stderr)
        raise SystemExit(2) from None
    report = {"cases": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.case and os.path.exists(args.out):
        with open(args.out) as fh:
            report = json.load(fh)

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as fh:
            json.dump(report, fh, indent=1, default=str)
        os.replace(args.out + ".tmp", args.out)
    if not args.case:  # the parent: every case in its own children
        save()
        for name, _, _ in CASES:
            if not args.only or any(x in name for x in args.only.split(",")):
                log("case", name)
                supervise(args, name)
        with open(args.out) as fh:
            report = json.load(fh)
        report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        report["keys_sweep_fit"] = fixed_cost_fit(report)
        save()
        print_table(report)
        return
    try:
        import torch
        import tvm
        dev = tvm.cuda(0)
        target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
        report.update(torch=torch.__version__, tvm=tvm.__version__, gpu=torch.cuda.get_device_name(0))
    except Exception:  # noqa: BLE001
        report["setup_error"] = traceback.format_exc()
        report["cases"].setdefault(args.case, {})["seconds"] = 0
        save()
        raise SystemExit(1)
    name, kind, s = next(c for c in CASES if c[0] == args.case)
    res = report["cases"].setdefault(name, {})
    t0 = time.time() - res.get("elapsed", 0)
    res.pop("error", None)
    save()
    try:
        run_case(name, kind, s, dev, target, res, generic=not args.no_generic and kind == "decode" or
                 (not args.no_generic and "fp16" in name and "causal" in name), report=report,
                 save=lambda: (res.update(elapsed=round(time.time() - t0, 1)), save()), only_knobs=only_knobs,
                 ablate=tuple(filter(None, args.ablate.split(","))), extra_knobs=extra_knobs)
    except Exception:  # noqa: BLE001
        res["error"] = traceback.format_exc()[-2000:]
        log("  FAILED", res["error"].splitlines()[-1])
    res.pop("elapsed", None)
    res["seconds"] = round(time.time() - t0, 1)
    log(f"  -> tvmfuse {res.get('tvmfuse_us', 'n/a')} us vs torch {res.get('torch_us', 'n/a')} us "
        f"({res.get('torch_choice')}), generic {res.get('tvm_generic_us', res.get('tvm_generic_error', 'n/a'))}")
    save()


if __name__ == "__main__":
    main()
