"""Shared test helpers: lower a tiny ONNX model, and compare its built module with onnxruntime."""

from tvm import relax

from tvmfuse.build import build
from tvmfuse.fuse import lower
from tvmfuse.importer import import_model, random_inputs
from tvmfuse.targets import device_for
from tvmfuse.verify import compare, onnxruntime_outputs, run_vm


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
