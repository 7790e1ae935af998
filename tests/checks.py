"""Shared test helpers: lower a tiny ONNX model, compare its built module with onnxruntime, read CUDA sources and
what ptxas says of them."""

import os
import subprocess
import tempfile

from tvm import relax

from tvmfuse.build.compile import build
from tvmfuse.fuse.fusion import lower
from tvmfuse.frontend.importer import import_model
from tvmfuse.verify import random_inputs
from tvmfuse.targets import device_for
from tvmfuse.verify.outputs import compare, onnxruntime_outputs, run_vm


def lower_model(model, shapes=None):
    """(imported, fused) for an ONNX model, with the whole pattern table."""
    imp = import_model(model, shapes)
    return imp, lower(imp.mod, imp.params)


def check_against_ort(model, imp, fused, target):
    """Build with default schedules, run on random inputs (symbolic dims = 3), compare with onnxruntime."""
    ex, _ = build(fused.mod, target)
    feeds = random_inputs(imp.inputs, dims={d: 3 for d in imp.symbolic_dims})
    dev = device_for(target)
    return compare(run_vm(relax.VirtualMachine(ex, dev), dev, list(feeds.values())), onnxruntime_outputs(model, feeds))


def cuda_sources(executable) -> list[str]:
    """The CUDA source of each CUDA module a built executable carries."""
    found = []

    def walk(mod):
        if mod.kind == "cuda":
            found.append(mod.inspect_source("cuda"))
        for sub in mod.imports:
            walk(sub)

    walk(executable.mod)
    return found


def assert_bad_inputs_exit_2(cases: dict, tmp_path, capsys, extra=()) -> None:
    """Each case {name: (args, message)} run through the CLI: exit 2, `message` in one `error:` line, nothing
    written under its --out. `extra` args go after each case's own."""
    from tvmfuse.cli.tune import main  # pylint: disable=import-outside-toplevel

    for case, (args, message) in cases.items():
        out = tmp_path / f"out-{case.replace(' ', '_')}"
        code = main(["--target", "llvm", "--trials", "0", "--out", str(out), "--logs", str(tmp_path / "l"),
                     *extra, *args])
        err = capsys.readouterr().err
        assert code == 2, case
        assert message in err, (case, err)
        assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, (case, err)
        assert not out.exists() or not any(out.iterdir()), case


def decode_attention(kv_len: int, mask_value: float | None = None, dt: str = "float16"):
    """softmax(q k^T / sqrt(128) [+ constant mask]) v at decode (1 query over `kv_len` keys, 8 heads, d 128),
    lowered with the attention pattern only: the Fused the kernel tests take templates from."""
    import numpy as np
    from tvm import relax

    from tvmfuse.fuse.fusion import lower
    from tvmfuse.patterns import fusion_patterns

    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((1, 8, 1, 128), dt))
    k, v = (relax.Var(n, relax.TensorType((1, 8, kv_len, 128), dt)) for n in "kv")
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            s = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
            s = bb.emit(relax.op.multiply(s, relax.const(128 ** -0.5, dt)))
            if mask_value is not None:
                s = bb.emit(relax.op.add(s, relax.const(np.full((1, 1, 1, kv_len), mask_value, dt))))
            out = bb.emit_output(relax.op.matmul(bb.emit(relax.op.nn.softmax(s, axis=-1)), v))
        bb.emit_func_output(out)
    return lower(bb.get(), patterns=fusion_patterns(["tvmfuse.attention"]))


def ptxas_report(src: str) -> tuple[int, str]:
    """nvcc's exit code and what ptxas says of CUDA source `src` for sm_90a (-Xptxas -v: registers, spills, and
    where it gives up on the wgmma pipeline, "Potential Performance Loss")."""
    with tempfile.TemporaryDirectory() as tmp:
        cu = os.path.join(tmp, "kernel.cu")
        with open(cu, "w", encoding="utf-8") as fh:
            fh.write(src)
        out = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "--use_fast_math", "-Xptxas", "-v",
                              "-o", os.path.join(tmp, "kernel.cubin"), cu], capture_output=True, text=True)
    return out.returncode, out.stdout + out.stderr
