"""Import stage: read an ONNX file, check it, and turn it into a Relax module with detached weights."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import onnx
import tvm
from tvm import relax

from tvmfuse.errors import ModelError
from tvmfuse.frontend import onnx_io
from tvmfuse.frontend.convert import from_onnx, unsupported_ops
from tvmfuse.frontend.lowering_check import carry_sources

ShapeSpec = dict[str, list[int | str]]  # input name -> dims (ints, or names kept symbolic)


@dataclass
class TensorInfo:
    """Name, dims (ints, or str for symbolic dims) and dtype of a model input or output."""

    name: str
    shape: list[int | str]
    dtype: str
    index_bound: int | None = None  # an integer input that indexes a weight table (token ids): its rows

    def as_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass
class Imported:
    """What the import stage hands to the next: the Relax module (weights as trailing params) and facts."""

    mod: tvm.IRModule
    params: list[tvm.runtime.Tensor]
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    onnx_model: onnx.ModelProto = field(repr=False)
    source: str = "model"  # the file (or what stands for it) that error messages name

    @property
    def symbolic_dims(self) -> list[str]:
        """The symbolic dims' names (a dim that is an expression of them, such as `past + seq`, is not one)."""
        return sorted({d for t in self.inputs for d in t.shape if isinstance(d, str) and d.isidentifier()})


def load_onnx(path: str) -> onnx.ModelProto:
    """Read and check an ONNX file; every failure is one ModelError naming the file and the problem."""
    if not os.path.exists(path):
        raise ModelError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelError(f"{path}: is a directory, not an ONNX file")
    if os.path.getsize(path) == 0:
        raise ModelError(f"{path}: empty file")
    try:  # the graph only: external data stays in its files (read by the importer, checked here)
        model = onnx.load(path, load_external_data=False)
    except Exception as err:  # protobuf raises DecodeError, onnx raises several others
        raise ModelError(f"{path}: not a readable ONNX model ({type(err).__name__}: {_first_line(err)})") from None
    if not model.graph.node and not model.graph.output:
        raise ModelError(f"{path}: not an ONNX model (no graph: truncated or another kind of file)")
    if onnx_io.has_external_data(model):  # files present and long enough, then the checker reads the file itself
        onnx_io.check_external_data(model, os.path.dirname(os.path.abspath(path)), path)
    try:
        onnx.checker.check_model(path if onnx_io.has_external_data(model) else model)
    except Exception as err:
        raise ModelError(f"{path}: invalid ONNX model: {_first_line(err)}") from None
    return model


def import_model(model: onnx.ModelProto, shapes: ShapeSpec | None = None, source: str = "model",
                 folder: str | None = None, weight_dtype: str | None = None) -> Imported:
    """ONNX -> Relax with weights detached; `shapes` fixes input dims (by input name or by dim name). `folder`: where
    the model's external data files are (the model file's folder; None: the current directory). `weight_dtype`
    ("float16"/"bfloat16", for big models): the matmul weights are read in it, one at a time; their params keep
    the fp32 type (`Imported.params` then holds tensors of another dtype than their params: binding casts them)."""
    _check_supported(model, source)
    inputs = _graph_inputs(model)
    shape_dict = _resolve_shapes(inputs, shapes or {}, source)
    try:
        mod = from_onnx(model, shape_dict=shape_dict or None, keep_params_in_input=True, folder=folder,
                        weight_dtype=weight_dtype)
    except ModelError:
        raise
    except Exception as err:
        raise ModelError(f"{source}: import failed: {type(err).__name__}: {_first_line(err)}") from None
    mod, params = (lambda pair: (carry_sources(mod, pair[0]), pair[1]))(relax.frontend.detach_params(mod))
    mod = bind_declared_dims(mod, model)
    main = mod["main"]
    n_in = int(main.attrs["num_input"])
    bounds = index_bounds(model)
    infos = [_info(p.name, p.ty, bounds.get(p.name)) for p in main.params[:n_in]]
    outputs = _output_infos(model, main.ret_ty)
    return Imported(mod, list(params.get("main", [])), infos, outputs, model, source)


def bind_declared_dims(mod: tvm.IRModule, model: onnx.ModelProto) -> tvm.IRModule:
    """An input dim that the graph also declares at an output which the import computed as an expression of other
    dims (a decoder step's `total`, its attention mask's length, at its present K/V: past + seq) becomes that
    expression, where the import made dims of it minus another (OPT's positions[:, past:], total - past, which
    FuseTIR cannot pass to a kernel); elsewhere it stays a dim of its own."""
    main = mod["main"]
    dims = {v.name: v for p in main.params if isinstance(p.ty, relax.TensorType) and p.ty.shape is not None
            for v in p.ty.shape.values if isinstance(v, tvm.tirx.Var)}
    fields = list(main.ret_ty.fields) if isinstance(main.ret_ty, relax.TupleType) else [main.ret_ty]
    binding = {}
    for value, ty in zip(model.graph.output, fields):
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            continue
        for declared, got in zip(_declared_dims(value), ty.shape.values):
            var = dims.get(declared)
            if var is not None and not isinstance(got, tvm.tirx.Var | tvm.tirx.IntImm) and not _mentions(got, var):
                binding.setdefault(var, got)
    binding = {var: got for var, got in binding.items() if _subtracted(main, var)}
    if binding:
        mod["main"] = main.bind_symbolic_vars(binding)
    return mod


def _mentions(expr, var) -> bool:
    """Whether the dim expression `expr` uses the symbolic dim `var`."""
    return any(v.same_as(var) for v in tvm.tirx.analysis.undefined_vars(expr))


def _subtracted(func: relax.Function, var) -> bool:
    """Whether some tensor in `func` has a dim that is `var` minus something."""
    found = []

    def visit(expr):
        ty = getattr(expr, "ty", None)
        if isinstance(ty, relax.TensorType) and ty.shape is not None and isinstance(ty.shape, relax.ShapeExpr):
            found.extend(d for d in ty.shape.values if isinstance(d, tvm.tirx.Sub) and _mentions(d, var))

    relax.analysis.post_order_visit(func.body, visit)
    return bool(found)


def _check_supported(model: onnx.ModelProto, source: str) -> None:
    missing = unsupported_ops(model)
    if missing:
        op, node = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelError(f"{source}: operator {op} (node {node or '?'}) is not supported by the importer{more}")


#: ops an index tensor passes through unchanged in value on its way from a graph input to a Gather
_INDEX_CARRIERS = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"}


def index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """{graph input: rows} for integer inputs that a Gather uses as indices into a weight (an embedding table, through
    casts and reshapes): the rows of the smallest such table, so verification can draw indices over all of them."""
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    inputs = {v.name for v in model.graph.input} - set(weights)
    source = {}  # tensor -> the graph input it carries unchanged
    for node in model.graph.node:  # nodes are topologically sorted in a valid model
        if node.op_type in _INDEX_CARRIERS and node.input and node.output:
            origin = node.input[0] if node.input[0] in inputs else source.get(node.input[0])
            if origin:
                source[node.output[0]] = origin
    bounds: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[0] not in weights:
            continue
        origin = node.input[1] if node.input[1] in inputs else source.get(node.input[1])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        dims = weights[node.input[0]]
        if origin and -len(dims) <= axis < len(dims) and dims[axis] > 0:
            bounds[origin] = min(bounds.get(origin, dims[axis]), dims[axis])
    return bounds


def _graph_inputs(model: onnx.ModelProto) -> list[TensorInfo]:
    weights = {t.name for t in model.graph.initializer}
    infos = []
    for value in model.graph.input:
        if value.name in weights:
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name
        infos.append(TensorInfo(value.name, _declared_dims(value), dtype))
    return infos


def _resolve_shapes(inputs: list[TensorInfo], shapes: ShapeSpec, source: str) -> dict[str, list]:
    """Apply `--shape` entries; a name is an input (full dims) or a symbolic dim (one int)."""
    by_input = {t.name: t for t in inputs}
    dim_values = {}
    out = {}
    for name, dims in shapes.items():
        if name in by_input:
            if len(dims) != len(by_input[name].shape):
                raise ModelError(f"{source}: --shape {name} has {len(dims)} dims, the input has "
                                 f"{len(by_input[name].shape)} ({_fmt(by_input[name].shape)})")
            out[name] = list(dims)
        elif len(dims) == 1 and any(name in t.shape for t in inputs):
            dim_values[name] = dims[0]
        else:
            dims_known = sorted({d for t in inputs for d in t.shape if isinstance(d, str)})
            raise ModelError(f"{source}: --shape {name}: no input or symbolic dim of that name "
                             f"(inputs: {', '.join(by_input)}; symbolic dims: {', '.join(dims_known) or 'none'})")
    if dim_values:
        for t in inputs:
            if t.name not in out and any(d in dim_values for d in t.shape):
                out[t.name] = [dim_values.get(d, d) if isinstance(d, str) else d for d in t.shape]
    for t in inputs:  # fixed inputs must be fully static ints; keep others as the model says
        if t.name in out:
            out[t.name] = [d if isinstance(d, str) and not d.isdigit() else int(d) for d in out[t.name]]
            if any(isinstance(d, int) and d <= 0 for d in out[t.name]):
                raise ModelError(f"{source}: --shape {t.name}: dims must be positive ({_fmt(out[t.name])})")
    return out


def _info(name: str, ty, index_bound: int | None = None) -> TensorInfo:
    dims = [int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in ty.shape]
    return TensorInfo(name, dims, str(ty.dtype), index_bound)


def _output_infos(model: onnx.ModelProto, ret_ty) -> list[TensorInfo]:
    """The outputs' names, dims and dtypes; an output whose dims the import lost keeps the ones its ONNX graph
    declares ("?" where it declares none)."""
    fields = list(ret_ty.fields) if isinstance(ret_ty, relax.TupleType) else [ret_ty]
    return [_info(o.name, f) if f.shape is not None else _declared_info(o, f)
            for o, f in zip(model.graph.output, fields)]


def _declared_info(value: onnx.ValueInfoProto, ty) -> TensorInfo:
    """An output whose dims the import lost: the dims its graph declares ("?" each where they are not its rank)."""
    dims = _declared_dims(value)
    return TensorInfo(value.name, dims if len(dims) == ty.ndim else ["?"] * max(ty.ndim, 0), str(ty.dtype))


def _declared_dims(value: onnx.ValueInfoProto) -> list[int | str]:
    """The dims an ONNX value declares: a dim's name, its size, or "?" where it declares neither."""
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in value.type.tensor_type.shape.dim]


def _fmt(dims) -> str:
    return "x".join(str(d) for d in dims)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


