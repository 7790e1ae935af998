"""The converter map tvmfuse imports with: TVM's Relax ONNX converters plus tvmfuse's overrides."""

from __future__ import annotations

import functools

import onnx
from tvm.relax.frontend.onnx import onnx_frontend as _tvm_onnx

from tvmfuse.frontend import mask_ops, shape_ops

# Ops that TVM's importer handles itself rather than through the converter map.
DIRECT_OPS = frozenset({"If", "Constant"})


@functools.cache
def convert_map() -> dict[str, type]:
    """TVM's converter map with tvmfuse's overriding converter classes substituted (a fresh dict, never TVM's)."""
    cmap = dict(_tvm_onnx._get_convert_map())
    cmap.update(shape_ops.OVERRIDES)
    cmap.update(mask_ops.OVERRIDES)
    return cmap


def unsupported_ops(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(op_type, node_name) of every node, subgraphs included, that no converter handles; nothing is converted."""
    return unsupported_nodes(model.graph)


def unsupported_nodes(graph: onnx.GraphProto) -> list[tuple[str, str]]:
    """`unsupported_ops` for a graph."""
    known = convert_map()
    found = []

    def walk(graph: onnx.GraphProto):
        for node in graph.node:
            if node.op_type not in known and node.op_type not in DIRECT_OPS:
                found.append((node.op_type, node.name))
            for attr in node.attribute:
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    walk(sub)

    walk(graph)
    return found
