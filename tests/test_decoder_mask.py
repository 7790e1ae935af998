"""prepare.decoder_mask: the exported causal + padding mask becomes one kernel only where probes show it is one."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from tvmfuse.prepare.decoder_mask import NAME, expected_mask, find_mask_sites, one_kernel_decoder_mask

MIN = float(np.finfo(np.float32).min)
CAPACITY = 24


def _step(window: int | None = None, uses_ids: bool = False, copies: int = 1) -> tvm.IRModule:
    """main(input_ids [batch, seq], attention_mask [batch, past + seq], past_len) -> the additive mask
    [batch, 1, seq, past + seq] as transformers builds it (aranges, a comparison, the padding, a where); `window`:
    a sliding window as well; `uses_ids`: the ids' padding instead of the attention mask's; `copies`: the mask
    built that many times (some exports build it anew in every layer), the output their sum."""
    batch, seq, past = (tirx.Var(n, "int64") for n in ("batch", "seq", "past"))
    ids = relax.Var("input_ids", relax.TensorType([batch, seq], "int64"))
    am = relax.Var("attention_mask", relax.TensorType([batch, past + seq], "int64"))
    pos = relax.Var("past_len", relax.ShapeType([past]))
    bb = relax.BlockBuilder()
    with bb.function("main", [ids, am, pos], attrs={"num_input": 3}):
        with bb.dataflow():
            e = bb.emit
            keys = e(relax.op.reshape(e(relax.op.arange(relax.prim_value(past + seq), dtype="int64")),
                                      [1, 1, 1, past + seq]))
            rows = e(relax.op.add(e(relax.op.arange(relax.prim_value(seq), dtype="int64")), relax.prim_value(past)))
            rows = e(relax.op.reshape(rows, [1, 1, seq, 1]))
            shown = e(relax.op.less_equal(keys, rows))
            if window:
                start = e(relax.op.subtract(rows, relax.const(window, "int64")))
                shown = e(relax.op.logical_and(shown, e(relax.op.greater(keys, start))))
            if uses_ids:
                first = e(relax.op.strided_slice(e(relax.op.astype(ids, "bool")), [1], [0], [1]))
                pad = e(relax.op.broadcast_to(e(relax.op.reshape(first, [batch, 1, 1, 1])), [batch, 1, 1, past + seq]))
            else:
                pad = e(relax.op.reshape(e(relax.op.astype(am, "bool")), [batch, 1, 1, past + seq]))
            shown = e(relax.op.broadcast_to(e(relax.op.logical_and(shown, pad)), [batch, 1, seq, past + seq]))
            masks = [e(relax.op.where(shown, relax.const(0.0, "float32"), relax.const(MIN, "float32")))]
            for _ in range(copies - 1):  # the same ops again (new bindings): the last where only
                again = e(relax.op.broadcast_to(e(relax.op.logical_and(e(relax.op.less_equal(keys, rows)), pad)),
                                                [batch, 1, seq, past + seq]))
                masks.append(e(relax.op.where(again, relax.const(0.0, "float32"), relax.const(MIN, "float32"))))
            out = masks[0] if copies == 1 else e(relax.op.maximum(masks[0], masks[1]))
            out = bb.emit_output(relax.op.multiply(out, relax.const(1.0, "float32")))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod: tvm.IRModule, seq: int, past: int, am: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    ids = tvm.runtime.tensor(np.ones((am.shape[0], seq), "int64"))
    return vm["main"](ids, tvm.runtime.tensor(am), tvm.runtime.ShapeTuple([past])).numpy()


def test_causal_padding_mask_becomes_one_kernel_with_the_same_values():
    mod = _step()
    new, notes = one_kernel_decoder_mask(mod, "attention_mask", "past_len", CAPACITY, [8])
    assert len(notes) == 1 and "one kernel" in notes[0], notes
    calls = [b.value for blk in new["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]
    assert [c.args[0].name_hint for c in calls] == [NAME]
    assert not any(b.value.op.name in ("relax.arange", "relax.less_equal") for blk in new["main"].body.blocks
                   for b in blk.bindings if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op))
    rng = np.random.default_rng(3)
    for seq, past in ((1, 0), (1, 9), (5, 3), (8, 0)):
        am = (rng.random((3, past + seq)) < 0.6).astype("int64")
        want = expected_mask(am, past, seq, MIN, "float32")
        np.testing.assert_array_equal(_run(mod, seq, past, am), want)  # the exported ops
        np.testing.assert_array_equal(_run(new, seq, past, am), want)  # the kernel


@pytest.mark.parametrize("window", [4, CAPACITY - 2])
def test_sliding_window_mask_stays_as_exported(window):
    """A window shorter than the cache differs from causal + padding at a long past: the probes up to the capacity
    find it, even where the window only bites past the prompts a short probe would use."""
    mod = _step(window=window)
    new, notes = one_kernel_decoder_mask(mod, "attention_mask", "past_len", CAPACITY, [])
    assert new is mod and len(notes) == 1 and "stays as exported" in notes[0] and "differs" in notes[0], notes


def test_mask_that_another_input_reaches_is_not_a_site():
    mod = _step(uses_ids=True)
    fn = mod["main"]
    assert not find_mask_sites(fn, fn.params[1])
    new, notes = one_kernel_decoder_mask(mod, "attention_mask", "past_len", CAPACITY, [])
    assert new is mod and not notes


def test_masks_built_in_every_layer_are_one_launch():
    mod = _step(copies=2)
    new, notes = one_kernel_decoder_mask(mod, "attention_mask", "past_len", CAPACITY, [])
    assert sum("one kernel" in n for n in notes) == 2 and "one launch" in notes[-1], notes
    calls = [b for blk in new["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]
    assert len(calls) == 1
    am = (np.random.default_rng(5).random((2, 7)) < 0.6).astype("int64")
    np.testing.assert_array_equal(_run(new, 4, 3, am), expected_mask(am, 3, 4, MIN, "float32"))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "gemma"])
def test_exported_decoders_masks_become_one_launch(arch, tmp_path):
    """transformers' decoders exported with a cache (torch.onnx, a mask built in every layer): each layer's mask is
    found, equals causal + padding on the probes, and the step launches one mask kernel."""
    import hf_export

    from tvmfuse.frontend import import_model, load_onnx
    from tvmfuse.prepare import prepare_module
    from tvmfuse.prepare.kv_cache import POSITION, in_place_kv_cache

    path = hf_export.export_with_cache(arch, str(tmp_path))
    imported = import_model(load_onnx(path), {}, path, str(tmp_path))
    mod, _ = in_place_kv_cache(prepare_module(imported), CAPACITY, [t.name for t in imported.outputs])
    new, notes = one_kernel_decoder_mask(mod, "attention_mask", POSITION, CAPACITY, [])
    assert sum("one kernel" in n for n in notes) >= 1 and not any("stays" in n for n in notes), notes
    calls = [b.value.args[0].name_hint for blk in new["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]
    assert calls.count(NAME) == 1
    assert not [b for blk in new["main"].body.blocks for b in blk.bindings
                if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.gather_nd"]
