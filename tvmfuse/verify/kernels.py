"""Output check of hand-written kernel variants: each built one against the generic kernel it replaces, on the
device that measures it."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile

import numpy as np
import tvm
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.support.tar import tar

from tvmfuse.kernels.substitution import constant_value
from tvmfuse.spaces.defaults import apply_default_schedules
from tvmfuse.verify.outputs import cast_array, compare

SEED = 0
MASK_STD = 3.0  # additive masks: N(0, 3^2), as tests/test_kernels.py draws them (zeros would hide a dropped mask)


class VariantCheck:
    """The generic kernel (default schedule, computing in float32: `in_float32`) run once on fixed random inputs;
    `check` runs built variants on the same inputs and compares with verify.py's tolerance for the kernel's dtype.
    Locally, on `tvm.runtime.device(target kind)`; with an RPC runner, in a session its `rpc_config` opens from
    the tracker (as the runner measures)."""

    def __init__(self, generic: tvm.tirx.PrimFunc, call, perm: list[int], target: tvm.target.Target, runner=None):
        self.target, self.perm, self.want = target, perm, None
        self.unusable: str | None = None  # why the check cannot run (set by its user): variants then go unchecked
        self.connect = getattr(getattr(runner, "rpc_config", None), "connect_server", None)
        infos, fields = ArgInfo.from_prim_func(generic), list(call.args[1].fields)
        rng = np.random.default_rng(SEED)
        self.inputs = []
        for i, (info, field) in enumerate(zip(infos, fields)):
            if i in perm:  # q, k, v ~ N(0, 1): logits q.k / sqrt(d) have unit variance (softmax not degenerate)
                self.inputs.append(random_array(rng, info, MASK_STD if perm.index(i) == 3 else 1.0))
            elif (value := constant_value(field)) is not None:  # softmax scale, where-guard value, constant zero mask
                self.inputs.append(value)
            else:
                raise ValueError(f"argument {i} is neither a template input nor a constant")
        self.outputs = _shapes(infos[len(fields):])
        if len(self.outputs) != 1:
            raise ValueError(f"{len(self.outputs)} outputs (a template writes one)")
        reference = in_float32(generic)
        ref_infos = ArgInfo.from_prim_func(reference)
        self.ref_inputs = [a.astype(dtype) for a, (_, dtype) in zip(self.inputs, _shapes(ref_infos))]
        self.ref_outputs = _shapes(ref_infos[len(fields):])
        mod = tvm.IRModule({"main": reference.with_attr("global_symbol", "main")})
        with target:
            lib = tvm.compile(apply_default_schedules(mod, target), target=target)
        self._dir = tempfile.TemporaryDirectory(prefix="tvmfuse-check-")
        self.reference = os.path.join(self._dir.name, f"reference.{tar.output_format}")
        lib.export_library(self.reference, fcompile=tar)

    def check(self, artifacts: list[str | None]) -> list[str | None]:
        """Per built variant (its builder artifact; None: not built, not checked): None when its output matches
        the generic kernel's, else what is wrong ('gave wrong output (max abs err X > tol ...)')."""
        out: list[str | None] = []
        with self._place() as (load, device):
            if self.want is None:
                self.want = self._run(load(self.reference, "reference"), device, self.ref_inputs, self.ref_outputs)
            for i, path in enumerate(artifacts):
                if path is None:
                    out.append(None)
                    continue
                try:
                    got = self._run(load(path, f"variant{i}"), device, [self.inputs[j] for j in self.perm],
                                    self.outputs)
                except Exception as err:  # pylint: disable=broad-except  (a variant that crashes is a wrong one)
                    why = (str(err).strip().splitlines() or [""])[-1]
                    out.append(f"failed its output check ({type(err).__name__}: {why})")
                    continue
                v = compare([got], [self.want], compute_dtype=self.outputs[0][1])
                atol, rtol = next(iter(v.tolerance.values())).values()
                out.append(None if v.ok else
                           f"gave wrong output (max abs err {v.max_abs_err:.3g} > tol {atol:g} + {rtol:g} * |ref|)")
        return out

    @staticmethod
    def _run(lib, device, arrays: list[np.ndarray], outputs: list) -> np.ndarray:
        (shape, dtype), = outputs
        args = [tvm.runtime.tensor(a, device) for a in arrays] + [tvm.runtime.empty(shape, dtype, device)]
        lib["main"](*args)
        device.sync()
        return args[-1].numpy()

    @contextlib.contextmanager
    def _place(self):
        """(load(artifact, tag) -> module, device): this process, or one RPC session (closed before the runner
        asks the tracker for its own, which with one server would otherwise wait for ours)."""
        kind = "cpu" if self.target.kind.name in ("llvm", "c") else self.target.kind.name
        if self.connect is None:
            yield (lambda path, _tag: tvm.runtime.load_module(path)), tvm.runtime.device(kind, 0)
            return
        session = self.connect()  # closed when the last reference to it goes, as `check` returns

        def load(path, tag):
            remote = f"tvmfuse_check_{tag}{os.path.splitext(path)[1]}"
            session.upload(path, remote)
            lib = session.load_module(remote)
            session.remove(remote)  # as MetaSchedule's RPC runner cleans up: the upload and the .so linked from it
            session.remove(remote + ".so")
            return lib

        yield load, session.device(kind, 0)


def in_float32(fn: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """`fn` computing in float32 where it computes in float16/bfloat16 (its TVMScript with those dtypes replaced),
    else `fn` itself: a half-precision generic kernel (softmax sums, matmuls accumulating in fp16) is itself off by
    more than fp16's tolerance at long sequences (0.012 at seq_k 4096 here), which failed every right variant."""
    try:
        return tvm.script.from_source(re.sub(r"\b(b?float16)\b", "float32", fn.script()))
    except Exception:  # pylint: disable=broad-except  (a kernel TVMScript does not print back: keep its precision)
        return fn


def _shapes(infos) -> list[tuple[tuple, str]]:
    return [(tuple(int(d) for d in i.shape), str(i.dtype)) for i in infos]


def random_array(rng, info, std: float) -> np.ndarray:
    """N(0, std^2) in the argument's dtype (zeros for integer/bool arguments)."""
    (shape, dtype), = _shapes([info])
    if not dtype.startswith(("float", "bfloat")):
        return np.zeros(shape, dtype)
    return cast_array(rng.standard_normal(shape).astype("float32") * std, dtype)
