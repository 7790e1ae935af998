"""One kernel of an exported model timed alone, on the arguments the model hands it and on random arguments of the
same shapes, in each dtype: whether a kernel's time in the model comes from its code, its data, or its neighbours
(issue 23: BERT's FFN GEMM with the erf-GELU epilogue took 146.4 us in bf16 against 124.5 in fp16 over 12 calls in
the model; alone, 10.4 us in both dtypes, on the model's arguments and on random ones: kernel_alone_run1.json).

    python3 bench/kernel_alone.py --model bert --case prefill_512 --kernel erf --dtypes fp16,bf16 --out DIR
    python3 bench/kernel_alone.py --smoke --out DIR     # CPU, tiny BERT, llvm: the flow, not the speed

The product builds the export (`pipeline.run_job`, `--trials 0`); one run of `main` with a VM instrument keeps the
first call of the kernel whose name holds `--kernel`: the function and copies of its arguments (taken before the
call, so an output buffer it overwrites is copied too). Then the kernel runs alone, `--iters` launches back to back
between two device syncs, median of 5: on those arguments, and on arguments of the same shapes and dtypes drawn from
a normal distribution with each argument's own mean and standard deviation. Writes DIR/kernel_alone.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import hf_models as hm  # noqa: E402


def fail(message: str):
    """One `error:` line and exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def capture(vm, run, needle: str) -> tuple:
    """(name, function, copies of its arguments) of the first function `run()` calls whose name holds `needle`."""
    import tvm
    kept: list = []

    def instrument(func, name, before, _ret, *args):
        if before and not kept and needle in str(name) and not str(name).startswith("vm."):
            kept.append((str(name), func, [tvm.runtime.tensor(a.numpy(), a.device)
                                           if isinstance(a, tvm.runtime.Tensor) else a for a in args]))

    vm.set_instrument(instrument)
    try:
        run()
    finally:
        vm.set_instrument(lambda *_: None)
    if not kept:
        fail(f"no kernel whose name holds {needle!r} ran")
    return kept[0]


def like(args: list, seed: int = 0) -> list:
    """Arguments of the same shapes and dtypes: float tensors from N(mean, std) of each one, others as they are."""
    import tvm
    rng = np.random.default_rng(seed)
    out = []
    for a in args:
        if isinstance(a, tvm.runtime.Tensor) and "float" in str(a.dtype):
            host = a.numpy()  # one copy from the device
            x = host.astype("float32")
            r = rng.standard_normal(x.shape).astype("float32") * float(x.std()) + float(x.mean())
            out.append(tvm.runtime.tensor(r.astype(host.dtype), a.device))
        else:
            out.append(a)
    return out


def time_alone(func, args, dev, iters: int) -> float:
    """Median over 5 of the microseconds per launch of `iters` launches back to back between two syncs."""
    func(*args)
    dev.sync()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            func(*args)
        dev.sync()
        runs.append((time.perf_counter() - t) / iters * 1e6)
    return float(np.median(runs))


def stats(args: list) -> list:
    import tvm
    return [{"shape": list(a.shape), "dtype": str(a.dtype),
             **({"mean": float(x.mean()), "std": float(x.std()), "max_abs": float(np.abs(x).max()),
                 "zeros": float((x == 0).mean())} if "float" in str(a.dtype) else {})}
            for a in args if isinstance(a, tvm.runtime.Tensor) for x in [a.numpy().astype("float32")]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bert", choices=("gpt2", "bert", "llama", "llama3"))
    p.add_argument("--case", default="prefill_512")
    p.add_argument("--kernel", default="erf", help="a substring of the kernel's name (its first call is timed)")
    p.add_argument("--dtypes", default="fp16,bf16")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--work", default="/tmp/kernel-alone")
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, llvm, fp32 (unless --dtypes)")
    args = p.parse_args()
    if args.smoke and args.dtypes == "fp16,bf16":
        args.dtypes, args.case = "fp32", "prefill_512"
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    import tvm
    import tvmfuse
    from tvmfuse import pipeline
    from tvmfuse.jobs import Job
    from tvmfuse.targets import resolve_target

    target = resolve_target("llvm" if args.smoke else "cuda")
    dev = tvm.cpu() if args.smoke else tvm.cuda(0)
    model = hm.build(args.model, args.smoke)
    feeds = hm.inputs(args.model, model, hm.shapes(args.model, args.case, model, args.smoke))
    path = os.path.join(args.work, f"{args.model}-{args.case}.onnx")
    hm.export(hm.wrap(model, args.case), feeds, path)
    rows = []
    for dtype in args.dtypes.split(","):
        job = Job(f"{args.model}-{args.case}-{dtype}", path, {}, 0, dtype)
        result = pipeline.run_job(job, target, os.path.join(args.work, "out"), os.path.join(args.work, "logs"),
                                  say=lambda _: None)
        if not result.ok:
            fail(f"the {dtype} build failed: {result.error}")
        loaded = tvmfuse.load(result.output, dev)
        name, func, real = capture(loaded.vm, lambda: loaded(feeds["input_ids"]), args.kernel)
        row = {"dtype": dtype, "kernel": name, "model_args_us": time_alone(func, real, dev, args.iters),
               "random_args_us": time_alone(func, like(real), dev, args.iters), "args": stats(real)}
        print(f"{dtype} {name[:80]}: model's arguments {row['model_args_us']:.1f} us, "
              f"random {row['random_args_us']:.1f} us", flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernel_alone.json"), "w", encoding="utf-8") as f:
        json.dump({"argv": sys.argv, "model": args.model, "case": args.case, "iters": args.iters,
                   "device": str(tvm.cuda(0).device_name) if not args.smoke else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
