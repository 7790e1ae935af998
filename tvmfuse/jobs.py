"""Job descriptions: models from the command line or a TOML jobs file, checked before any work starts."""

from __future__ import annotations

import difflib
import math
import numbers
import os
import re
from dataclasses import dataclass, field

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from tvmfuse.errors import JobError
from tvmfuse.export.library import check_safe_name
from tvmfuse.prepare.dtypes import check_io_dtype, parse_dtype

MODEL_KEYS = {"name", "path", "shapes", "trials", "dtype", "io_dtype", "buckets", "tolerance", "kv_cache", "max_seq",
              "weights"}
TOP_KEYS = {"trials", "model", "dtype", "io_dtype", "tolerance", "weights"}
#: where a job's weights go (`--weights`, export.weights.outside): by the model's size, always outside, always inside
WEIGHT_PLACEMENTS = ("auto", "external", "library")


@dataclass
class Job:
    """One model to import, fuse, tune, build, verify and export. `path=None` is the embedded default."""

    name: str
    path: str | None
    shapes: dict[str, list[int]] = field(default_factory=dict)
    trials: int | None = None
    dtype: str = "float32"  # compute dtype: float32, float16 or bfloat16 (tvmfuse.precision)
    io_dtype: str = "float32"  # dtype of the module's float inputs/outputs: float32 or the compute dtype
    batch: int | None = None  # candidates built and measured per tuning round (None: 16 on CPUs, 64 on GPUs)
    buckets: dict[str, list[int]] = field(default_factory=dict)  # symbolic dim -> bucket values (tvmfuse.buckets)
    cuda_graph: bool = False  # cuda: replay static launch sequences as CUDA graphs (tvmfuse.build.compile_module)
    dependent_launch: bool = True  # sm_90+: kernels launched while the one before ends (False or the switch at 0: off)
    low_lookups: bool = True  # embedding lookups in the compute dtype, so the residual stream too (prepare.precision)
    tolerance: tuple[float, float] | None = None  # (atol, rtol) for every float output (None: verify.TOLERANCES)
    kv_cache: str | None = None  # "inplace" / "onnx" (None: in place where the model has the cache idiom)
    max_seq: int | None = None  # the in-place cache's capacity (None: the largest bucket, else DEFAULT_MAX_SEQ)
    weights: str = "auto"  # WEIGHT_PLACEMENTS: outside model.so by size, always, or never (export.weights.outside)

    def __post_init__(self):
        self.dtype = parse_dtype(self.dtype, "dtype")  # "fp16" from a library caller: the verifier's tolerance key
        if self.tolerance is not None:
            self.tolerance = parse_tolerance(self.tolerance, "tolerance")
        self.weights = check_weights(self.weights)


def check_weights(value, where: str = "--weights") -> str:
    """A weights placement, one of WEIGHT_PLACEMENTS."""
    if value not in WEIGHT_PLACEMENTS:
        raise JobError(f"{where} {value!r}: expected one of {', '.join(WEIGHT_PLACEMENTS)}")
    return value


def parse_shape(text: str) -> tuple[str, list[int]]:
    """`x=1,128,64` / `x=1x128x64` (an input) or `seq=128` (a symbolic dim) -> (name, dims)."""
    name, sep, dims = text.partition("=")
    if not sep or not name.strip() or not re.fullmatch(r"\s*\d+(\s*[,x]\s*\d+)*\s*", dims):
        raise JobError(f"--shape {text!r}: expected NAME=DIMS, e.g. x=1,128,768 or seq=128")
    return name.strip(), [int(d) for d in re.split(r"[,x]", dims)]


def parse_buckets(texts: list[str]) -> dict[str, list[int]]:
    """`--buckets seq=1,128,512` (repeatable: several dims give the cross product) -> {dim: sorted values}."""
    out: dict[str, list[int]] = {}
    for text in texts:
        name, sep, values = text.partition("=")
        name = name.strip()
        if not sep or not name or not values.strip():
            raise JobError(f"--buckets {text!r}: expected DIM=V1,V2,..., e.g. seq=1,128,512")
        if name in out:
            raise JobError(f"--buckets {name} is given twice: put all of its values in one --buckets {name}=...")
        out[name] = bucket_values(f"--buckets {text!r}", [v.strip() for v in values.split(",")])
    return out


def bucket_values(where: str, values: list) -> list[int]:
    """Positive integers (ints, or digit strings from the command line), sorted, duplicates dropped."""
    for v in values:
        if isinstance(v, bool) or not (isinstance(v, int) or isinstance(v, str) and v.isdigit()) or int(v) <= 0:
            raise JobError(f"{where}: bucket values must be positive integers, not {v!r}")
    return sorted({int(v) for v in values})


def parse_tolerance(value, where: str = "--tolerance") -> tuple[float, float]:
    """'0.02,0.02' (the command line) or [0.02, 0.02] (a jobs file) -> (atol, rtol), two finite numbers >= 0."""
    text = isinstance(value, str)
    parts = value.split(",") if text else value
    try:
        if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and all(
                text or isinstance(p, numbers.Real) and not isinstance(p, bool) for p in parts)):
            raise ValueError
        atol, rtol = (float(p) for p in parts)
    except ValueError:
        raise JobError(f"{where} {value!r}: expected ATOL,RTOL (two numbers), e.g. "
                       + ("--tolerance 0.02,0.02" if where.startswith("--") else "tolerance = [0.02, 0.02]")) from None
    for key, num in (("atol", atol), ("rtol", rtol)):
        if not (math.isfinite(num) and num >= 0):
            raise JobError(f"{where} {value!r}: {key} {num:g} must be a finite number >= 0")
    return atol, rtol


def job_from_path(path: str, shapes: dict[str, list[int]], trials: int | None, dtype: str = "float32") -> Job:
    stem = os.path.splitext(os.path.basename(path))[0]
    return Job(name=_sanitize(stem), path=path, shapes=dict(shapes), trials=trials, dtype=dtype)


def _sanitize(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem).lstrip(".") or "model"


def load_jobs(path: str, trials: int | None = None, dtype: str = "float32", io_dtype: str = "float32",
              tolerance: tuple[float, float] | None = None, weights: str = "auto") -> list[Job]:
    """Read a jobs file; a typo'd key, a bad value or a duplicate name is one JobError naming the file."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise JobError(f"{path}: no such jobs file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise JobError(f"{path}: not valid TOML: {err}") from None
    _check_keys(path, "top level", data, TOP_KEYS)
    models = data.get("model")
    if not isinstance(models, list) or not models:
        raise JobError(f"{path}: no [[model]] entries")
    default_trials = _trials(path, "top level", data.get("trials", trials))
    default_dtype = _dtype(path, "top level", data.get("dtype", dtype))
    default_io = _dtype(path, "top level", data.get("io_dtype", io_dtype), "io_dtype")
    default_tol = _tolerance(path, "top level", data.get("tolerance", tolerance))
    default_weights = _in_file(path, "top level", check_weights, data.get("weights", weights), "weights")
    base = os.path.dirname(os.path.abspath(path))
    jobs, seen = [], set()
    for i, entry in enumerate(models, 1):
        where = f"model #{i}"
        if not isinstance(entry, dict):
            raise JobError(f"{path}: {where} is not a table")
        _check_keys(path, where, entry, MODEL_KEYS)
        if "path" not in entry:
            raise JobError(f"{path}: {where} has no 'path'")
        model_path = os.path.join(base, str(entry["path"]))
        name = str(entry.get("name", _sanitize(os.path.splitext(os.path.basename(model_path))[0])))
        _in_file(path, where, check_safe_name, name)
        if name in seen:
            raise JobError(f"{path}: {where}: duplicate name {name!r}")
        seen.add(name)
        job_dtype = _dtype(path, where, entry.get("dtype", default_dtype))
        shapes = entry.get("shapes", {})
        if not isinstance(shapes, dict) or not all(
                isinstance(v, list) and v and all(isinstance(d, int) and d > 0 for d in v) or
                isinstance(v, int) and v > 0 for v in shapes.values()):
            raise JobError(f"{path}: {where}: 'shapes' must map names to lists of positive ints "
                           "(an input) or to one int (a symbolic dim)")
        shapes = {k: v if isinstance(v, list) else [v] for k, v in shapes.items()}
        jobs.append(Job(name, model_path, shapes, _trials(path, where, entry.get("trials", default_trials)),
                        job_dtype, _io_dtype(path, where, entry.get("io_dtype", default_io), job_dtype)))
        jobs[-1].buckets = _buckets(path, where, entry.get("buckets", {}))
        jobs[-1].tolerance = _tolerance(path, where, entry.get("tolerance", default_tol))
        jobs[-1].kv_cache, jobs[-1].max_seq = _kv_cache(path, where, entry)
        jobs[-1].weights = _in_file(path, where, check_weights, entry.get("weights", default_weights), "weights")
    return jobs


def _kv_cache(path: str, where: str, entry: dict) -> tuple[str | None, int | None]:
    """A model's `kv_cache = "inplace" | "onnx"` and `max_seq = N` (the in-place cache's capacity)."""
    mode, max_seq = entry.get("kv_cache"), entry.get("max_seq")
    if mode not in (None, "inplace", "onnx"):
        raise JobError(f"{path}: {where}: 'kv_cache' must be \"inplace\" or \"onnx\", not {mode!r}")
    if max_seq is not None and (not isinstance(max_seq, int) or isinstance(max_seq, bool) or max_seq <= 0):
        raise JobError(f"{path}: {where}: 'max_seq' must be a positive integer, not {max_seq!r}")
    return mode, max_seq


def _trials(path: str, where: str, value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise JobError(f"{path}: {where}: 'trials' must be a non-negative integer, not {value!r}")
    return value


def _in_file(path: str, where: str, parse, *args):
    """parse(*args), its JobError naming the jobs file and the entry."""
    try:
        return parse(*args)
    except JobError as err:
        raise JobError(f"{path}: {where}: {err}") from None


def _dtype(path: str, where: str, value, key: str = "dtype") -> str:
    return _in_file(path, where, parse_dtype, value, key)


def _tolerance(path: str, where: str, value) -> tuple[float, float] | None:
    return None if value is None else _in_file(path, where, parse_tolerance, value, "tolerance")


def _io_dtype(path: str, where: str, value, dtype: str) -> str:
    return _in_file(path, where, check_io_dtype, value, dtype, "io_dtype")


def _buckets(path: str, where: str, value) -> dict[str, list[int]]:
    """A model's `buckets = { seq = [1, 128, 512] }` (one int also accepted) -> {dim: sorted values}."""
    if not isinstance(value, dict):
        raise JobError(f"{path}: {where}: 'buckets' must map symbolic dims to lists of positive ints, "
                       "e.g. buckets = { seq = [1, 128, 512] }")
    return {dim: bucket_values(f"{path}: {where}: buckets {dim}", v if isinstance(v, list) and v else [v])
            for dim, v in value.items()}


def _check_keys(path: str, where: str, table: dict, allowed: set[str]) -> None:
    for key in table:
        if key not in allowed:
            hint = difflib.get_close_matches(key, sorted(allowed), n=1)
            more = f" (did you mean {hint[0]!r}?)" if hint else f" (allowed: {', '.join(sorted(allowed))})"
            raise JobError(f"{path}: {where}: unknown key {key!r}{more}")
