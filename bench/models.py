"""Issue 9 bench: GPT-2 (124M), BERT-base and a Llama layer end to end from ONNX, fp16 and/or bf16 — tvmfuse (the
product path, `pipeline.run_job` with --dtype fp16|bf16, + a CUDA-graph build) vs TVM default (no pattern fusion,
dlight) vs torch eager / torch.compile in the same dtype, at decode (batch 1-16, KV 512) and prefill (512, 2048)
shapes. Every row is checked against torch fp32 with the same weights, at its dtype's tolerance
(tvmfuse.verify.TOLERANCES: fp16 1e-2, bf16 8e-2), and says how many elements fall outside it. Writes
DIR/models.json after every row, a PNG at the end.

    python3 bench/models.py --models gpt2,llama,bert --cases decode_b1,decode_b16,prefill_512,prefill_2048 \\
        --contenders tvmfuse,tvmfuse_cuda_graph,torch_eager,torch_compile,tvm_default --budget-s 480 --out DIR
    python3 bench/models.py --models llama,gpt2,bert --cases decode_b1,decode_b16,prefill_512,prefill_2048 \\
        --dtypes fp16,bf16 --contenders tvmfuse_cuda_graph,torch_compile_reduce_overhead --out DIR3
    python3 bench/models.py --cases decode_b1,decode_b16 --contenders torch_compile_reduce_overhead --out DIR2
    python3 bench/models.py --smoke --out /tmp/smoke    # CPU, tiny configs, llvm, fp32, decode_b1
"""

from __future__ import annotations

import argparse, copy, datetime, gc, json, math, multiprocessing, os, platform, sys, time, traceback  # noqa: E401
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import hf_models as hm, model_builds  # noqa: E402
from bench.model_timing import run_torch, run_tvm  # noqa: E402

CONTENDERS = ["tvmfuse", "tvmfuse_cuda_graph", "tvmfuse_before", "torch_eager", "torch_compile",
              "torch_compile_reduce_overhead", "tvm_default"]
T0 = time.time()
RES: dict = {}
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def torch_dtype(dtype: str):
    import torch
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]


def parse_dtypes(text: str) -> list[str]:
    """'fp16,bf16' -> ['float16', 'bfloat16'] (each as tvmfuse's --dtype spells it); a bad one is a clear error."""
    from tvmfuse.errors import JobError
    from tvmfuse.prepare.dtypes import parse_dtype
    try:
        dtypes = [parse_dtype(d, "--dtypes") for d in text.split(",") if d.strip()]
    except JobError as err:
        raise SystemExit(f"error: {err}") from None
    if not dtypes or len(set(dtypes)) != len(dtypes):
        raise SystemExit(f"error: --dtypes {text!r}: name each of fp32, fp16, bf16 at most once")
    return dtypes


def _no_gpu():
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # builders never touch the GPU the measurements use


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def save(out: str) -> None:
    with open(os.path.join(out, "models.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def versions() -> dict:
    import onnx, onnxruntime, torch, transformers, tvm  # noqa: E401
    import tvmfuse
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "tvm": tvm.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "tvmfuse": tvmfuse.__version__, "numpy": np.__version__}


def measure_case(args, info: dict, model, target, dev, ceilings, dtype: str) -> None:
    """Every wanted contender of one (model, case) in `dtype` on the same inputs, against torch fp32 with the same
    weights at `dtype`'s tolerance."""
    import torch
    name, case = info["model"], info["case"]
    s = hm.shapes(name, case, model, args.smoke)
    cuda = target.kind.name == "cuda"
    tdev, tdt = ("cuda" if cuda else "cpu"), torch_dtype(dtype)
    params = sum(p.numel() for p in model.parameters())
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    base = {"model": name, "case": case, "dtype": SHORT[dtype], **s, "params": params, "export_s": info["export_s"],
            "prepare_s": info["prepare_s"], "same_weights_as_onnx": None if info["param_checksum"] is None
            else abs(checksum - info["param_checksum"]) < 1e-6}
    if case.startswith("decode") and not hm.has_cache(name):
        base["note"] = "BERT has no KV cache: sequence 1 without past (the closest the export allows)"
    if ceilings:
        layers, kvh, hd = hm.cache_dims(model)
        kv_bytes = 2 * 2 * layers * s["batch"] * kvh * s["kv_len"] * hd
        base["ideal_us"] = max((params * 2 + kv_bytes) / ceilings[0], 2 * params * s["batch"] * s["seq"] / ceilings[1]) * 1e6
    feeds = hm.inputs(name, model, s)
    with torch.no_grad():
        ref_model = copy.deepcopy(model).to(tdev)
        out = hm.wrap(ref_model, case)(*[torch.from_numpy(v).to(tdev) for v in feeds.values()])
        ref = [o.float().cpu().numpy() for o in (out if isinstance(out, tuple) else (out,))]
        del ref_model, out
        low = hm.wrap(hm.to_low_precision(copy.deepcopy(model), tdt, tdev), case)
    ctx = {"info": info, "feeds": feeds, "ref": ref, "dtype": dtype, "dev": dev, "cuda": cuda, "torch_low": low,
           "profile": args.profile,
           "torch_dtype": tdt,
           "torch_in": [torch.from_numpy(v).to(tdev, tdt if v.dtype.kind == "f" else None) for v in feeds.values()]}
    jobs = {"tvmfuse": lambda: run_tvm(ctx, "tvmfuse"),
            "tvmfuse_cuda_graph": lambda: run_tvm(ctx, "tvmfuse_cuda_graph"),
            "tvmfuse_before": lambda: run_tvm(ctx, "tvmfuse_before"),
            "torch_eager": lambda: run_torch(ctx, None),
            "torch_compile": lambda: run_torch(ctx, "default"),
            "torch_compile_reduce_overhead": lambda: run_torch(ctx, "reduce-overhead"),
            "tvm_default": lambda: run_tvm(ctx, "tvm_default")}
    wanted = args.contenders.split(",") + (["tvmfuse_before"] if args.before else [])
    for key in [c for c in CONTENDERS if c in wanted and (c != "tvmfuse_before" or args.before)]:
        if key in ("tvmfuse_cuda_graph", "torch_compile_reduce_overhead") and not cuda:
            _row(args, dict(base, contender=key, skipped="CUDA graphs: CUDA only"))
            continue
        if time.time() - T0 > args.budget_s:
            _row(args, dict(base, contender=key, skipped=f"budget ({args.budget_s} s) spent"))
            continue
        try:
            _row(args, dict(base, **jobs[key]()))
        except Exception:  # pylint: disable=broad-except  (one contender's failure must not lose the others)
            _row(args, dict(base, contender=key, error=traceback.format_exc()[-3000:]))
        gc.collect()
    ctx.clear()  # the low-precision torch copy and the inputs go before the next case
    del low
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    for root, _, files in os.walk(os.path.join(args.work, model_builds.case_dir(name, case, dtype))):
        for f in files:
            if f.endswith(".so"):  # hundreds of MB each (the weights are inside)
                os.remove(os.path.join(root, f))


def _row(args, row: dict) -> None:
    RES["rows"].append(row)
    save(args.out)
    what = (f"{row['us']:.1f} us, err {row['max_abs_err']:.2e}" if "us" in row else
            row.get("skipped") or "FAILED " + row.get("error", "").strip().splitlines()[-1][:300])
    log(row["model"], row["case"], row.get("dtype", ""), row["contender"], what)


def summary(rows: list[dict]) -> dict:
    """Per model/case/dtype ("llama/prefill_512/bf16"): each contender's us, and the best tvmfuse build against
    the best torch.compile mode in the same dtype. A TVM result counts only if its output is right: finite, and
    within its dtype's tolerance or no further from torch fp32 than twice torch's own error in that dtype (a
    4096-wide random-weight Llama is off by 0.15 in torch fp16 itself); the others are listed under
    "wrong_output" with their error, elements outside the tolerance and time."""
    out: dict = {}
    torch_err = {(r["model"], r["case"], r.get("dtype")): r["max_abs_err"] for r in rows
                 if r.get("contender") == "torch_eager" and "max_abs_err" in r}
    for r in rows:
        if "us" not in r:
            continue
        us = out.setdefault(f"{r['model']}/{r['case']}/{r.get('dtype')}", {})
        err, ref = r.get("max_abs_err"), torch_err.get((r["model"], r["case"], r.get("dtype")))
        right = r["contender"].startswith("torch") or (
            err is not None and math.isfinite(err) and (r.get("within_tol") or (ref is not None and err <= 2 * ref)))
        if right:
            us[r["contender"]] = round(r["us"], 1)
        else:
            us.setdefault("wrong_output", {})[r["contender"]] = {"us": round(r["us"], 1), "max_abs_err": err,
                                                                 "violations": r.get("violations")}
    for us in out.values():
        ours = min((us[k] for k in ("tvmfuse", "tvmfuse_cuda_graph") if k in us), default=None)
        theirs = min((us[k] for k in ("torch_compile", "torch_compile_reduce_overhead") if k in us), default=None)
        if ours and theirs:
            us["speedup_vs_torch_compile"] = round(theirs / ours, 2)
    return out


def chart(out: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable: no PNG"
    groups = list(dict.fromkeys((r["model"], r["case"], r.get("dtype")) for r in RES["rows"]))
    fig, axs = plt.subplots(1, len(groups), figsize=(2.8 * len(groups), 3.4), squeeze=False)
    for ax, (m, c, d) in zip(axs[0], groups):
        rows = {r["contender"]: r["us"] for r in RES["rows"]
                if (r["model"], r["case"], r.get("dtype")) == (m, c, d) and "us" in r}
        keys = [k for k in CONTENDERS if k in rows]
        ax.bar(range(len(keys)), [rows[k] for k in keys], color=[f"C{CONTENDERS.index(k)}" for k in keys])
        ax.set_xticks(range(len(keys)), [k.replace("torch_compile", "compile").replace("_reduce_overhead", "+ro")
                                         .replace("tvmfuse_cuda_graph", "tvmfuse+cg") for k in keys],
                      rotation=60, fontsize=7)
        ax.set_title(f"{m} {c} {d or ''}", fontsize=8)
        values = [rows[k] for k in keys]
        if values and max(values) > 20 * min(values):  # a generic kernel beside tuned ones: only a log axis shows both
            ax.set_yscale("log")
            ax.set_ylim(bottom=min(values) / 3)
        else:  # bars from zero: their heights compare as the times do
            ax.set_ylim(0, max(values, default=1) * 1.15)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_ylabel("us (median" + (", log)" if ax.get_yscale() == "log" else ")"), fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "models.png"), dpi=70)
    return "models.png"


def main(argv=None) -> dict:
    global T0  # pylint: disable=global-statement
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2,bert,llama")
    p.add_argument("--cases", default=None, help="decode_b<N>, prefill_512, prefill_2048 (smoke: decode_b1)")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--last", default="prefill_2048", help="cases run after all models' other cases")
    p.add_argument("--trials", type=int, default=0, help="0: schedules/ library + default schedules + templates")
    p.add_argument("--budget-s", type=float, default=540, help="start no new contender after this many seconds")
    p.add_argument("--out", default="bench-models")
    p.add_argument("--work", default="/tmp/bench-models", help="ONNX files, exports and tuning logs")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny configs, llvm target, fp32 (unless --dtypes)")
    p.add_argument("--dtypes", default=None, help="compute dtypes to measure, side by side: fp16, bf16 or both "
                   "(fp16,bf16); every contender runs in each (torch in the same dtype). Default: fp16 (smoke: fp32)")
    p.add_argument("--overlap", action="store_true", help="measure while later builds still run (faster, but "
                   "the CPU load slows launch-bound contenders); default: all builds first, then measurements")
    p.add_argument("--profile", action="store_true", help="per-kernel times and where non-finite values appear "
                   "(one instrumented call of each TVM contender) and, on CUDA, every contender's kernels as the "
                   "device recorded them (CUPTI via torch.profiler)")
    p.add_argument("--jobs", type=int, default=None, help="worker processes that export and build ahead of the "
                   "measurements (GPU hidden from them; --trials 0 only); 0: build in this process (default: 4, "
                   "smoke 0)")
    p.add_argument("--without-templates", default="", metavar="NAMES", help="comma-separated kernel templates "
                   "the builds leave out (e.g. attention_prefill_wgmma: the mma.sync prefill then, a before/after "
                   "pair with a run without this option)")
    p.add_argument("--before", default="", metavar="NAMES", help="comma-separated kernel templates: each case is "
                   "also built without them (from the same export) and measured as tvmfuse_before (with a CUDA graph "
                   "on CUDA): a before/after pair in one run, e.g. --before attention_prefill_wgmma; also "
                   "dependent_launch (none launched dependent), generic_waits (only the TIRx kernels) and "
                   "early_weights (the GEMMs' weights loaded before their wait, off by default: on in the "
                   "other build), smallm_ring (the small-M GEMMs' weight ring of 4 stages, likewise), "
                   "smallm_bulk (that ring filled by bulk copies, up to 4 stages, likewise), smallm_m1 "
                   "(M = 1 GEMMs on the small-M kernel, on by default: the GEMV schedule in the other build), "
                   "wgmma_waits (the wgmma GEMMs launched dependent, off by default: on in the other build), "
                   "merge_siblings (every sibling group merged, off by default: on in the other build), "
                   "split_reads (the attention reads Q, K and V where a split would cut them, on by default: every "
                   "split launched in the other build); untuned: "
                   "built with --trials 0 (with --trials N: what tuning bought, and changed_kernels)")
    p.add_argument("--chart", metavar="MODELS.json", help="only draw the PNG of a finished run (next to it)")
    args = p.parse_args(argv)
    if args.chart:
        with open(args.chart, encoding="utf-8") as f:
            RES.clear()
            RES.update(json.load(f))
        print(chart(os.path.dirname(os.path.abspath(args.chart))))
        return RES
    for flag, given in (("--without-templates", args.without_templates), ("--before", args.before)):
        unknown = model_builds.unknown_names([n for n in given.split(",") if n])
        if unknown:
            p.error(f"{flag}: unknown name {unknown[0]!r} (a template of tvmfuse.kernels.table or one of "
                    f"{', '.join(model_builds.SWITCHES)})")
    args.cases = args.cases or ("decode_b1" if args.smoke else "decode_b1,decode_b16,prefill_512,prefill_2048")
    args.dtypes = parse_dtypes(args.dtypes or ("fp32" if args.smoke else "fp16"))
    args.jobs = (0 if args.smoke else 4) if args.jobs is None else args.jobs
    T0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    import torch
    from tvmfuse.build.dependent_launch import applies_to
    from tvmfuse.kernels.dependent_launch import early_weights, release_late, wgmma_waits
    from tvmfuse.kernels.hopper.mma_smallm import bulk_stages, ring_stages, takes_m1
    from tvmfuse.kernels.hopper.select import merges_siblings_always
    for name, (switch, on) in model_builds.off_by_default().items():  # on in the build measured against
        if name in args.before.split(","):
            os.environ[switch] = on
    from tvmfuse.targets import device_for, resolve_target
    torch.set_grad_enabled(False)
    target = resolve_target("llvm" if args.smoke else "cuda")
    dev = device_for(target)
    RES.clear()
    RES.update(date=datetime.datetime.now().isoformat(timespec="seconds"), argv=sys.argv if argv is None else argv,
               versions=versions(), smoke=args.smoke, dtypes=[SHORT[d] for d in args.dtypes],
               target=str(target.attrs.get("arch", "llvm")),
               models={m: hm.NOTES[m] for m in args.models.split(",")}, rows=[],
               without_templates=[n for n in args.without_templates.split(",") if n],
               before=[n for n in args.before.split(",") if n],
               dependent_launch=applies_to(target) and ("late" if release_late() else True),
               early_weights=applies_to(target) and early_weights(), smallm_ring=ring_stages(),
               smallm_bulk=bulk_stages(),
               smallm_m1=takes_m1(), wgmma_waits=wgmma_waits(), merge_siblings=merges_siblings_always(),
               notes="us: median latency of one call with inputs already on the device (torch: CUDA events; TVM: "
                     "time_evaluator); max_abs_err vs torch fp32 (same weights, same inputs), within_tol and "
                     "violations (elements outside) by tvmfuse.verify.compare at the row's dtype's tolerance (fp16: "
                     "atol 1e-2 + rtol 1e-2, bf16: 8e-2 + 8e-2); ideal_us: all 2-byte weights (+KV) once at "
                     "the measured copy bandwidth, or 2*params*tokens FLOPs at the measured matmul peak; with --jobs N "
                     "the exports and builds ran in N CPU worker processes, before the measurements unless --overlap "
                     "(then during them)")
    ceilings = None
    if target.kind.name == "cuda":
        from bench.run import ceilings as measure_ceilings
        ceilings = measure_ceilings()
        RES.update(gpu=torch.cuda.get_device_name(), copy_bw_TBps=ceilings[0] / 1e12,
                   matmul_peak_TFLOPs=ceilings[1] / 1e12)
    save(args.out)
    late = args.last.split(",")  # these cases after every model's others: the budget cuts them first
    pairs = [(m, c, d) for m in args.models.split(",") for c in args.cases.split(",") if c not in late
             for d in args.dtypes]
    pairs += [(m, c, d) for c in args.cases.split(",") if c in late for m in args.models.split(",")
              for d in args.dtypes]
    wanted = args.contenders.split(",")
    opts = {"smoke": args.smoke, "trials": args.trials, "work": args.work,
            "target": "llvm" if args.smoke else "cuda", "default": "tvm_default" in wanted,
            "graph": not args.smoke and "tvmfuse_cuda_graph" in wanted,
            "without_templates": [n for n in args.without_templates.split(",") if n],
            "before": [n for n in args.before.split(",") if n]}
    needs_build = any(c in wanted for c in ("tvmfuse", "tvmfuse_cuda_graph", "tvm_default"))
    workers = args.jobs if args.trials == 0 and needs_build else 0  # tuning measures on the GPU: build here
    pool, futures = None, {}
    if workers:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_no_gpu,
                                   max_tasks_per_child=1)  # a fresh process per build: memory back each time
        futures = {(m, c): pool.submit(model_builds.prepare, m, c, opts, args.dtypes)
                   for m, c in dict.fromkeys((m, c) for m, c, _ in pairs)}  # one export per case, every dtype
    if workers and not args.overlap:  # measure on an idle CPU: launch-bound contenders (torch eager, the VM) slow
        deadline = T0 + args.budget_s  # down while builds run beside them
        for fut in futures.values():
            try:
                fut.result(timeout=max(1.0, deadline - time.time()))
            except Exception:  # pylint: disable=broad-except  (its row reports it below)
                pass
    built: dict = {}  # the fp32 HF models (CPU), built once each
    here: dict = {}  # without workers: (model, case) -> {dtype: build info}, built in this process
    for name, case, dtype in pairs:
        where = {"model": name, "case": case, "dtype": SHORT[dtype], "contender": "-"}
        if time.time() - T0 > args.budget_s:
            _row(args, dict(where, skipped=f"budget ({args.budget_s} s) spent"))
            continue
        log("===", name, case, SHORT[dtype])
        try:
            if name not in built:
                built[name] = hm.build(name, args.smoke)
            model = built[name]
            if workers:  # wait for its build no longer than the budget lasts
                info = futures[(name, case)].result(timeout=max(1.0, args.budget_s - (time.time() - T0)))[dtype]
            elif not needs_build:  # torch contenders only: no ONNX, no TVM
                info = {"model": name, "case": case, "export_s": None, "prepare_s": None, "param_checksum": None}
            else:
                if (name, case) not in here:
                    here[(name, case)] = model_builds.prepare(name, case, opts, args.dtypes)
                info = here[(name, case)][dtype]
            log(name, case, SHORT[dtype], "built", {k: info[k] for k in ("export_s", "prepare_s")})
            measure_case(args, info, model, target, dev, ceilings, dtype)
        except FuturesTimeout:
            _row(args, dict(where, skipped="budget spent waiting for its build"))
        except Exception:  # pylint: disable=broad-except
            _row(args, dict(where, error=traceback.format_exc()[-3000:]))
    if pool is not None:  # stop builds nobody will measure (workers are this script's own processes)
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            proc.terminate()
    RES["summary"] = summary(RES["rows"])
    RES["chart"] = chart(args.out)
    RES["seconds"] = round(time.time() - T0, 1)
    save(args.out)
    for r in RES["rows"]:
        print(f"{r['model']:6} {r['case']:13} {r.get('dtype', ''):5} {r['contender']:30}",
              f"{r['us']:10.1f} us  err {r['max_abs_err']:.2e}, {r['violations']} outside" if "us" in r
              else (r.get("skipped") or "FAILED"))
    return RES


if __name__ == "__main__":
    main()
