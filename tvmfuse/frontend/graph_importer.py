"""A subclass of TVM's Relax ONNX graph importer that uses tvmfuse's converter map and names failing nodes."""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _tvm_onnx

from tvmfuse.errors import ModelError
from tvmfuse.frontend.convert_map import convert_map, unsupported_nodes
from tvmfuse.frontend.lowering_check import note_sources, with_sources
from tvmfuse.frontend.onnx_io import cast_array, has_external_data, is_external, read_external


# Ops whose TVM (or tvmfuse) converters accept shape-valued (relax.ShapeExpr) inputs.
SHAPE_AWARE_OPS = frozenset({"Reshape", "Resize", "ConstantOfShape", "Gather", "Slice", "Shape", "Expand",
                             "Concat", "Equal", "Where", "Cast", "CastLike", "Squeeze"})


class Importer(_tvm_onnx.ONNXGraphImporter):
    """ONNXGraphImporter whose op lookups go through `convert_map()` instead of TVM's module global."""

    def _check_for_unsupported_ops(self, graph: onnx.GraphProto):
        bad = unsupported_nodes(graph)
        if bad:
            op, name = bad[0]
            raise ModelError(f"cannot import ONNX op {op} (node {name!r}): no Relax converter for it"
                             + (f" ({len(bad) - 1} more unsupported nodes)" if len(bad) > 1 else ""))

    def _shape_inputs_as_tensors(self, node: onnx.NodeProto) -> onnx.NodeProto:
        """TVM refuses shape-valued inputs for ops outside its shape-aware list; feed those an int64 tensor: a
        constant where every dim is static (so the arithmetic on it folds: torch.split's `(dim + 2) // 3` of a
        static dim gives Slice constant bounds, where a runtime tensor lost the slice's dims), else shape_to_tensor."""
        if node.op_type in SHAPE_AWARE_OPS:
            return node
        renamed = None
        for i, name in enumerate(node.input):
            value = self._nodes.get(name)
            if value is not None and isinstance(getattr(value, "ty", None), relax.ShapeType):
                alias = f"{name}__as_tensor"
                if alias not in self._nodes:
                    dims = getattr(value.ty, "values", None)
                    static = dims is not None and all(isinstance(d, tvm.tirx.IntImm) for d in dims)
                    self._nodes[alias] = (relax.const(np.array([int(d) for d in dims], "int64")) if static
                                          else self.bb.normalize(relax.op.shape_to_tensor(value)))
                if renamed is None:
                    renamed = onnx.NodeProto()
                    renamed.CopyFrom(node)
                renamed.input[i] = alias
        return renamed or node

    def _name_lost_dims(self, node: onnx.NodeProto):
        """Give a tensor whose rank is known but whose dims were lost fresh symbolic dims (a MatchCast), so later
        ops that need dims (Reshape with -1, Expand, Slice) still import."""
        for k, name in enumerate(node.output):
            value = self._nodes.get(name)
            ty = getattr(value, "ty", None)
            if isinstance(ty, relax.TensorType) and ty.shape is None and ty.ndim > 0:
                dims = [tvm.tirx.Var(f"{node.op_type.lower()}{k}_d{i}", "int64") for i in range(ty.ndim)]
                self._nodes[name] = self.bb.match_cast(value, relax.TensorType(dims, ty.dtype))

    def _construct_nodes(self, graph: onnx.GraphProto):
        # TVM converts node by node; run it one node at a time so a failure can name the node.
        self.op_sources = getattr(self, "op_sources", {})
        for node in graph.node:
            sub = onnx.GraphProto()
            sub.node.append(self._shape_inputs_as_tensors(node))
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # TVM prints its own partial message first
                    super()._construct_nodes(sub)
                note_sources(self.bb, [self._nodes.get(o) for o in node.output], node, self.op_sources, {})
                self._name_lost_dims(node)
            except ModelError:
                raise
            except Exception as err:  # noqa: BLE001 - any converter failure becomes one clear line
                why = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                raise ModelError(f"cannot import ONNX op {node.op_type} (node {node.name!r}): {why}") from err

    folder = "."  # where external data files are (import_graph sets the model's folder)
    read_as: dict[str, str] = {}  # initializer -> the dtype its values are stored in once read (import_graph)

    def _parse_array(self, tensor_proto: onnx.TensorProto) -> tvm.runtime.Tensor:
        """An initializer's values; external data is read from its file in the model's folder, not the cwd; one
        named in `read_as` is cast as it is read (its fp32 values freed at once)."""
        dtype = self.read_as.get(tensor_proto.name)
        if not is_external(tensor_proto):
            array = super()._parse_array(tensor_proto)
            return array if dtype is None else tvm.runtime.tensor(cast_array(array.numpy(), dtype))
        values = read_external(tensor_proto, self.folder)
        return tvm.runtime.tensor(values if dtype is None else cast_array(values, dtype))

    def _parse_graph_initializers(self, graph: onnx.GraphProto):
        """TVM's, then each weight read in another dtype gets back its fp32 param (the graph stays fp32)."""
        super()._parse_graph_initializers(graph)
        for name in self.read_as:
            var_name = name.removeprefix("onnx::")
            if var_name in self._params:
                array = self._params[var_name][1]
                self._nodes[name] = self._new_var(var_name, shape=array.shape, dtype="float32")
                self._params[var_name] = (self._nodes[name], array)

    def _convert_operator(self, op_name, inputs, attrs, opset):
        cmap = convert_map()
        if op_name not in cmap:
            raise NotImplementedError(f"Operator {op_name} not implemented.")
        sym = cmap[op_name].get_converter(opset)(self.bb, inputs, attrs, [self._nodes, self._params])
        if isinstance(sym, relax.Expr):
            sym = self.bb.normalize(sym)
        return sym


def _opset(model: onnx.ModelProto) -> int:
    for ident in model.opset_import:
        if ident.domain in ("", "ai.onnx"):
            return ident.version
    return 1


def matmul_weights(model: onnx.ModelProto) -> list[str]:
    """The float32 initializers read only as a MatMul's or Gemm's second operand (the weights a matmul kernel
    casts to its compute dtype whatever happens around it)."""
    uses: dict[str, set[tuple[str, int]]] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, set()).add((node.op_type, i))
    outputs = {o.name for o in model.graph.output}
    return [t.name for t in model.graph.initializer
            if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2 and t.name not in outputs
            and uses.get(t.name) and uses[t.name] <= {("MatMul", 1), ("Gemm", 1)}]


def import_graph(model: onnx.ModelProto, shape_dict=None, keep_params_in_input: bool = True,
                 folder: str | None = None, weight_dtype: str | None = None) -> tvm.IRModule:
    """Convert an (already pre-processed) ONNX model with the tvmfuse importer; external data is read from
    `folder` (the model file's folder; None: the current directory). `weight_dtype` ("float16"/"bfloat16"): the
    matmul weights (`matmul_weights`) are read in that dtype, one at a time (a big model never holds their fp32
    copy); their params keep the fp32 type, so whoever binds them casts them back."""
    if model.ir_version < 3:
        raise ModelError(f"ONNX IR version {model.ir_version} is too old (need >= 3)")
    if not has_external_data(model):  # an external-data model was checked by path when loaded
        try:
            onnx.checker.check_model(model)
        except Exception as exc:  # noqa: BLE001 - same as TVM: checker problems are only warnings
            warnings.warn(str(exc))
    importer = Importer(shape_dict, "float32", keep_params_in_input=keep_params_in_input, sanitize=True)
    importer.folder = folder or "."
    # (as params only: a constant read in another dtype would change the graph's types)
    importer.read_as = dict.fromkeys(matmul_weights(model), weight_dtype) if weight_dtype and keep_params_in_input \
        else {}
    mod = importer.from_onnx(model.graph, _opset(model))
    return with_sources(mod, getattr(importer, "op_sources", {}))  # named if a call is left unlowered
