"""Hand-written kernel templates: CPU variants vs numpy, CUDA variants compile with nvcc, registry and substitute."""

from __future__ import annotations

import os
import re
import shutil

import ml_dtypes  # noqa: F401  (numpy's "bfloat16" dtype: the bf16 variants' inputs and outputs)
import numpy as np
import pytest
import tvm
from tvm import relax

from tvmfuse.kernels import ATTENTION_DECODE, ATTENTION_PREFILL, ATTENTION_STEP, lookup, substitute
from tvmfuse.kernels.attention.decode import chunk_of

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
H100 = tvm.target.Target("nvidia/nvidia-h100", host={"kind": "llvm"})  # sm_90a, what `--target cuda` builds for


def ref(q, k, v, mask=None, causal=False, softcap=None):
    """softmax(softcap(Q K^T / sqrt(d)) + mask) V on [B,H,S,D] arrays, with the exports' isnan -> 0 guard;
    softcap(x) = cap * tanh(x / cap) (Gemma 2), or x."""
    kk, vv = np.repeat(k, q.shape[1] // k.shape[1], 1).astype("f4"), np.repeat(v, q.shape[1] // v.shape[1], 1).astype("f4")
    s = q.astype("f4") @ kk.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if mask is not None:
        s = s + mask.astype("f4")
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - s.max(-1, keepdims=True))
        p = np.nan_to_num(p / p.sum(-1, keepdims=True), nan=0.0)
    return p @ vv


def run_cpu(fn, args, out_shape, dtype):
    ex = tvm.compile(tvm.IRModule({"main": fn}), target="llvm")
    out = tvm.runtime.tensor(np.zeros(out_shape, dtype))
    ex["main"](*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy().astype("f4")


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype,tol", [("float16", 2e-3), ("bfloat16", 2e-2), ("float32", 1e-4)])
@pytest.mark.parametrize("split", [1, 4])
def test_decode_cpu_matches_numpy(dtype, tol, split):
    """Split-KV online softmax + combine, GQA (8 query heads over 2 KV heads)."""
    s = dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_k=256, head_dim=64, dtype=dtype)
    rng = np.random.default_rng(split)
    q, k, v = rand(rng, (2, 8, 1, 64), dtype), rand(rng, (2, 2, 256, 64), dtype), rand(rng, (2, 2, 256, 64), dtype)
    got = run_cpu(ATTENTION_DECODE(s, {"split": split}, "llvm"), [q, k, v], q.shape, dtype)
    assert np.abs(got - ref(q, k, v)).max() < tol


@pytest.mark.parametrize("dtype,tol", [("float16", 2e-3), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("variant", ["causal", "additive", "none"])
def test_prefill_cpu_matches_numpy(variant, dtype, tol):
    """Tile-wise online softmax over block_n=32 tiles; causal tile skipping; additive broadcast mask; GQA."""
    s = dict(batch=1, heads=4, kv_heads=2, seq_q=64, seq_k=64, head_dim=64, dtype=dtype,
             causal=variant == "causal", mask="additive" if variant == "additive" else "none", mask_shape=(1, 1, 64, 64))
    rng = np.random.default_rng(7)
    q, k, v = rand(rng, (1, 4, 64, 64), dtype), rand(rng, (1, 2, 64, 64), dtype), rand(rng, (1, 2, 64, 64), dtype)
    mask = (rng.standard_normal((1, 1, 64, 64)) * 3).astype(dtype)
    args = [q, k, v] + ([mask] if variant == "additive" else [])
    got = run_cpu(ATTENTION_PREFILL(s, {"warps": 4, "block_n": 32}, "llvm"), args, q.shape, dtype)
    want = ref(q, k, v, mask if variant == "additive" else None, variant == "causal")
    assert np.abs(got - want).max() < tol


@pytest.mark.parametrize("head_dim", [256, 96, 80])
@pytest.mark.parametrize("heads,kv_heads,split", [(8, 4, 1), (8, 1, 4)])
def test_decode_cpu_at_gemmas_and_phis_head_dims_matches_numpy(heads, kv_heads, split, head_dim):
    """Gemma's head dim 256 (2B, 7B, Gemma 2's 2B and 9B: a warp's 32 lanes x 8 values hold one key) and Phi-2's 80
    and Phi-3's 96 (16 lanes a key, the last idle): the decode template takes them, in GQA and MQA; the CPU variant
    against numpy."""
    s = dict(batch=2, heads=heads, kv_heads=kv_heads, seq_q=1, seq_k=100, head_dim=head_dim, dtype="float16")
    assert ATTENTION_DECODE.check(s) is None
    rng = np.random.default_rng(heads + split)
    q, k, v = (rand(rng, (2, h, L, head_dim), "float16") for h, L in ((heads, 1), (kv_heads, 100), (kv_heads, 100)))
    got = run_cpu(ATTENTION_DECODE(s, {"split": split}, "llvm"), [q, k, v], q.shape, "float16")
    assert np.abs(got - ref(q, k, v)).max() < 2e-3


def test_the_decode_lanes_of_a_key_are_a_power_of_two():
    """The warp sums' shuffles need a power of two of lanes a key: 80 and 96 take 16 (two keys a warp, as 128 does),
    so a step of 4 warps x 2 unroll is 16 keys; the CUDA source of a power-of-two head dim has no lane guard."""
    from tvmfuse.kernels.attention.decode_knobs import keys_per_warp, lanes

    assert [lanes(d) for d in (16, 32, 64, 80, 96, 128, 256)] == [2, 4, 8, 16, 16, 16, 32]
    assert [keys_per_warp(d) for d in (64, 80, 96, 128)] == [4, 2, 2, 2]
    s = dict(batch=1, heads=8, kv_heads=8, seq_q=1, seq_k=100, head_dim=96, dtype="float16")
    assert chunk_of(s, {"split": 4, "warps": 4, "unroll": 2}) == 32  # ceil(100 / 4) = 25 -> whole steps of 16
    assert "d0 < 96" in ATTENTION_DECODE(s, {"split": 4, "warps": 4, "unroll": 2}).script()
    assert "d0 < " not in ATTENTION_DECODE(dict(s, head_dim=128), {"split": 4, "warps": 4, "unroll": 2}).script()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("head_dim", [256, 96, 80])
def test_cuda_decode_at_head_dim_256_compiles_with_each_default(head_dim):
    """The GPU variant at head dims 256 (a lane's 8 values, the 32 lanes' warp sum a key's score), 96 and 80 (16 lanes
    a key) compiles with nvcc under the default knobs of a static and a symbolic KV length, and every knob set fits
    its combine in 48 KB."""
    for seq_k in (4096, "past + seq"):
        s = dict(batch=1, heads=8, kv_heads=4, seq_q=1, seq_k=seq_k, head_dim=head_dim, dtype="bfloat16")
        knobs = ATTENTION_DECODE.default_knobs(s)
        assert "__shfl_xor_sync" in _cuda_compiles(ATTENTION_DECODE(s, knobs), H100), knobs
    if head_dim == 256:
        assert {k["warps"] for k in ATTENTION_DECODE.knob_space(dict(s, kv_heads=1))} == {2, 4}  # MQA: 8 rows a block


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [256, 96, 80])
def test_gpu_decode_at_head_dim_256_matches_numpy(head_dim):
    """On a GPU: the decode CUDA variant at head dims 256, 96 and 80 against numpy, every warps x unroll at split 4
    and 16."""
    dev, rng = tvm.cuda(0), np.random.default_rng(9)
    s = dict(batch=2, heads=8, kv_heads=4, seq_q=1, seq_k=513, head_dim=head_dim, dtype="float16")
    q, k, v = rand(rng, (2, 8, 1, head_dim), "float16"), rand(rng, (2, 4, 513, head_dim), "float16"), \
        rand(rng, (2, 4, 513, head_dim), "float16")
    for knobs in [k for k in ATTENTION_DECODE.knob_space(s) if k["split"] in (4, 16)]:
        lib = tvm.compile(tvm.IRModule({"main": ATTENTION_DECODE(s, knobs)}), target=CUDA)
        out = tvm.runtime.tensor(np.zeros(q.shape, "float16"), dev)
        lib["main"](*[tvm.runtime.tensor(a, dev) for a in (q, k, v)], out)
        assert np.abs(out.numpy().astype("f4") - ref(q, k, v)).max() < 5e-3, knobs


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_cpu_at_gemmas_head_dim_256_matches_numpy(causal):
    """Gemma's head dim 256 in the prefill template (so the step template takes Gemma's in-place cache too): 32-key
    tiles, one 16-row tile a warp; the CPU variant against numpy."""
    s = dict(batch=1, heads=4, kv_heads=1, seq_q=64, seq_k=64, head_dim=256, dtype="bfloat16", causal=causal,
             mask="none" if causal else "additive", mask_shape=(1, 1, 64, 64))
    assert {(k["block_n"], k["m_tiles"]) for k in ATTENTION_PREFILL.knob_space(s)} == {(32, 1)}

    step = dict(s, seq_q="seq", seq_k="past + seq", causal=False, mask="additive",
                mask_shape=(1, 1, "seq", "past + seq"))
    assert ATTENTION_STEP.check(step) is None  # an in-place cache's step: both branches take head dim 256
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, (1, 4, 64, 256), "bfloat16"), rand(rng, (1, 1, 64, 256), "bfloat16"), \
        rand(rng, (1, 1, 64, 256), "bfloat16")
    mask = None if causal else (rng.standard_normal((1, 1, 64, 64)) * 3).astype("bfloat16")
    got = run_cpu(ATTENTION_PREFILL(s, {"warps": 4, "block_n": 32}, "llvm"),
                  [q, k, v] + ([] if causal else [mask]), q.shape, "bfloat16")
    assert np.abs(got - ref(q, k, v, mask, causal)).max() < 2e-2


@pytest.mark.parametrize("head_dim", [80, 96])
def test_prefill_cpu_at_phis_head_dims_matches_numpy(head_dim):
    """Phi-2's head dim 80 and Phi-3's 96 (five and six 16-wide k-steps) in the prefill template, causal and with an
    additive mask; the CPU variant against numpy. The decode template takes them too, so the step template does."""
    rng = np.random.default_rng(head_dim)
    for causal in (True, False):
        s = dict(batch=1, heads=4, kv_heads=2, seq_q=64, seq_k=64, head_dim=head_dim, dtype="float16", causal=causal,
                 mask="none" if causal else "additive", mask_shape=(1, 1, 64, 64))
        q, k, v = (rand(rng, (1, h, 64, head_dim), "float16") for h in (4, 2, 2))
        mask = None if causal else (rng.standard_normal((1, 1, 64, 64)) * 3).astype("float16")
        knobs = ATTENTION_PREFILL.default_knobs(s)
        got = run_cpu(ATTENTION_PREFILL(s, knobs, "llvm"), [q, k, v] + ([] if causal else [mask]), q.shape, "float16")
        assert np.abs(got - ref(q, k, v, mask, causal)).max() < 2e-3, (causal, knobs)
    step = dict(s, batch="batch", seq_q="seq", seq_k="past + seq", mask="additive",
                mask_shape=(1, 1, "seq", "past + seq"))
    assert ATTENTION_DECODE.check(dict(s, seq_q=1, causal=False, mask="none")) is None
    assert ATTENTION_STEP.check(step) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("head_dim", [80, 96])
def test_cuda_prefill_at_phis_head_dims_compiles_without_spills(head_dim):
    """At Phi's head dims, 32 heads at 2048 tokens: every knob set compiles and ptxas spills nothing in any."""
    from checks import ptxas_report  # pylint: disable=import-outside-toplevel

    s = dict(batch=1, heads=32, kv_heads=32, seq_q=2048, seq_k=2048, head_dim=head_dim, dtype="bfloat16",
             causal=True)
    for knobs in ATTENTION_PREFILL.knob_space(s):
        src = tvm.compile(tvm.IRModule({"main": ATTENTION_PREFILL(s, knobs)}), target=H100).mod.imports[0] \
            .inspect_source("cuda")
        code, said = ptxas_report(src)
        spills = re.findall(r"(\d+) bytes spill stores", said)
        assert code == 0 and spills and set(spills) == {"0"}, (knobs, said[-2000:])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_cuda_prefill_at_head_dim_256_fits_its_registers():
    """The GPU variant at head dim 256, Gemma 2 9B's heads at 2048 tokens: every knob set compiles, and ptxas spills
    nothing under the default (255 registers a thread)."""
    from checks import ptxas_report  # pylint: disable=import-outside-toplevel

    s = dict(batch=1, heads=16, kv_heads=8, seq_q=2048, seq_k=2048, head_dim=256, dtype="float16", causal=True)
    for knobs in ATTENTION_PREFILL.knob_space(s):
        src = tvm.compile(tvm.IRModule({"main": ATTENTION_PREFILL(s, knobs)}), target=H100).mod.imports[0] \
            .inspect_source("cuda")
        code, said = ptxas_report(src)
        assert code == 0, said[-2000:]
        if knobs == ATTENTION_PREFILL.default_knobs(s):
            assert " 0 bytes spill stores" in said, said[-2000:]


@pytest.mark.gpu
def test_gpu_prefill_at_head_dims_256_96_80_matches_numpy():
    """On a GPU: the prefill CUDA variant at head dims 256, 96 and 80, every knob set, causal and with an additive
    mask."""
    dev, rng = tvm.cuda(0), np.random.default_rng(12)
    for causal, d in ((True, 256), (False, 256), (True, 96), (False, 96), (True, 80), (False, 80)):
        s = dict(batch=1, heads=4, kv_heads=2, seq_q=128, seq_k=128, head_dim=d, dtype="float16", causal=causal,
                 mask="none" if causal else "additive", mask_shape=(1, 1, 128, 128))
        q, k, v = (rand(rng, (1, h, 128, d), "float16") for h in (4, 2, 2))
        mask = None if causal else (rng.standard_normal((1, 1, 128, 128)) * 3).astype("float16")
        for knobs in ATTENTION_PREFILL.knob_space(s):
            lib = tvm.compile(tvm.IRModule({"main": ATTENTION_PREFILL(s, knobs)}), target=CUDA)
            out = tvm.runtime.tensor(np.zeros(q.shape, "float16"), dev)
            lib["main"](*[tvm.runtime.tensor(a, dev) for a in [q, k, v] + ([] if causal else [mask])], out)
            assert np.abs(out.numpy().astype("f4") - ref(q, k, v, mask, causal)).max() < 5e-3, (causal, d, knobs)


SOFTCAP = 1.5  # small beside the scores of the inputs below (4 x randn of 64 dims: |s| up to ~15), so it matters


@pytest.mark.parametrize("tmpl,split_or_variant", [("decode", 1), ("decode", 4), ("prefill", "additive"),
                                                   ("prefill", "causal")])
def test_soft_capped_scores_match_numpy_on_cpu(tmpl, split_or_variant):
    """cap * tanh(s / cap) on the scaled scores before the mask (Gemma 2): the decode and prefill CPU variants
    match numpy, and numpy without the cap is far from them (the cap is applied, not dropped)."""
    rng = np.random.default_rng(11)
    dt, seq_q = "float16", 1 if tmpl == "decode" else 64
    q = (rng.standard_normal((1, 4, seq_q, 64)) * 4).astype(dt)
    k, v = rand(rng, (1, 2, 64, 64), dt), rand(rng, (1, 2, 64, 64), dt)
    s = dict(batch=1, heads=4, kv_heads=2, seq_q=seq_q, seq_k=64, head_dim=64, dtype=dt, softcap=SOFTCAP)
    mask = None
    if tmpl == "decode":
        fn = ATTENTION_DECODE(s, {"split": split_or_variant}, "llvm")
    else:
        causal = split_or_variant == "causal"
        s.update(causal=causal, mask="none" if causal else "additive", mask_shape=(1, 1, 64, 64))
        mask = None if causal else (rng.standard_normal((1, 1, 64, 64)) * 3).astype(dt)
        fn = ATTENTION_PREFILL(s, {"warps": 4, "block_n": 32}, "llvm")
    got = run_cpu(fn, [q, k, v] + ([mask] if mask is not None else []), q.shape, dt)
    causal = s.get("causal", False)
    assert np.abs(got - ref(q, k, v, mask, causal, softcap=SOFTCAP)).max() < 3e-3
    assert np.abs(got - ref(q, k, v, mask, causal)).max() > 0.1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_cuda_soft_capped_variants_compile_and_the_wgmma_template_refuses_them():
    """The decode and mma.sync prefill CUDA variants with a soft cap compile with nvcc and call tanhf; the Hopper
    template says why it does not take them (the pipeline then takes the mma.sync one)."""
    from tvmfuse.kernels import ATTENTION_PREFILL_WGMMA  # pylint: disable=import-outside-toplevel

    dec = dict(batch=1, heads=8, kv_heads=4, seq_q=1, seq_k=4096, head_dim=128, dtype="float16", softcap=50.0)
    assert "tanhf(" in _cuda_compiles(ATTENTION_DECODE(dec, {"split": 16, "warps": 4, "unroll": 2}))
    pre = dict(batch=1, heads=8, kv_heads=4, seq_q=256, seq_k=256, head_dim=128, dtype="bfloat16", causal=True,
               softcap=50.0)
    assert "tanhf(" in _cuda_compiles(ATTENTION_PREFILL(pre, {"warps": 4, "block_n": 64}))
    assert "soft-capped" in ATTENTION_PREFILL_WGMMA.check(dict(pre, arch="sm_90a"))
    assert ATTENTION_PREFILL_WGMMA.check(dict(pre, arch="sm_90a", softcap=0)) is None


@pytest.mark.gpu
def test_gpu_soft_capped_scores_match_numpy():
    """On a GPU: the decode and prefill CUDA variants with a soft cap against numpy."""
    dev, rng = tvm.cuda(0), np.random.default_rng(5)
    for tmpl, s, knobs in [
        (ATTENTION_DECODE, dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_k=512, head_dim=128, dtype="float16"),
         {"split": 4, "warps": 4, "unroll": 2}),
        (ATTENTION_PREFILL, dict(batch=1, heads=4, kv_heads=2, seq_q=128, seq_k=128, head_dim=64, dtype="float16",
                                 causal=True), {"warps": 4, "block_n": 32})]:
        b, hq, hk, d = s["batch"], s["heads"], s["kv_heads"], s["head_dim"]
        q = (rng.standard_normal((b, hq, s["seq_q"], d)) * 4).astype("float16")
        k, v = rand(rng, (b, hk, s["seq_k"], d), "float16"), rand(rng, (b, hk, s["seq_k"], d), "float16")
        lib = tvm.compile(tvm.IRModule({"main": tmpl(dict(s, softcap=SOFTCAP), knobs)}), target=CUDA)
        out = tvm.runtime.tensor(np.zeros(q.shape, "float16"), dev)
        lib["main"](*[tvm.runtime.tensor(a, dev) for a in (q, k, v)], out)
        want = ref(q, k, v, causal=s.get("causal", False), softcap=SOFTCAP)
        assert np.abs(out.numpy().astype("f4") - want).max() < 5e-3, tmpl.name


def _cuda_compiles(fn, target=CUDA):
    ex = tvm.compile(tvm.IRModule({"main": fn}), target=target)
    src = ex.mod.imports[0].inspect_source("cuda")
    with target:
        assert len(tvm.support.nvcc.compile_cuda(src, "fatbin", compiler="nvcc")) > 1000
    return src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_cuda_variants_compile():
    """The GPU variants at the issue's shapes (bf16 and fp16, causal/mask, hd 64/128) compile with nvcc."""
    dec = dict(batch=16, heads=32, kv_heads=8, seq_q=1, seq_k=4096, head_dim=128, dtype="float16")
    src = _cuda_compiles(ATTENTION_DECODE(dec, {"split": 16, "warps": 4, "unroll": 2}))
    assert "__shfl_xor_sync" in src
    pre = dict(batch=1, heads=32, kv_heads=8, seq_q=256, seq_k=256, head_dim=128, dtype="bfloat16", causal=True)
    src = _cuda_compiles(ATTENTION_PREFILL(pre, {"warps": 4, "block_n": 64}))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src and "ldmatrix" in src
    pre.update(dtype="float16", causal=False, mask="additive", mask_shape=(1, 1, 256, 256), head_dim=64)
    _cuda_compiles(ATTENTION_PREFILL(pre, {"warps": 8, "block_n": 128}))


def test_registry_lookup_and_knobs():
    dec = dict(batch=1, heads=32, kv_heads=8, seq_q=1, seq_k=4096, head_dim=128, dtype="float16")
    pre = dict(dec, seq_q=2048, seq_k=2048, causal=True)
    assert lookup("tvmfuse.attention", dec) is ATTENTION_DECODE
    assert lookup("tvmfuse.attention", pre) is ATTENTION_PREFILL
    assert lookup("tvmfuse.attention", dict(pre, head_dim=80)) is ATTENTION_PREFILL  # Phi-2's
    assert lookup("tvmfuse.attention", dict(pre, head_dim=72)) is None  # 4.5 mma k-steps of 16: refused
    assert lookup("tvmfuse.attention", dict(pre, dtype="float32")) is None
    assert lookup("tvmfuse.swiglu", dec) is None
    assert ATTENTION_DECODE.check(dict(dec, kv_heads=5)) is not None
    space = ATTENTION_DECODE.knob_space(dec)
    assert {"split": 32, "warps": 4, "unroll": 2} in space and ATTENTION_DECODE.default_knobs(dec) in space
    assert ATTENTION_PREFILL.default_knobs(pre) in ATTENTION_PREFILL.knob_space(pre)


def test_templates_take_bf16_and_name_a_dtype_they_refuse():
    dec = dict(batch=1, heads=32, kv_heads=8, seq_q=1, seq_k=4096, head_dim=128, dtype="bfloat16")
    pre = dict(dec, seq_q=2048, seq_k=2048, causal=True)
    assert lookup("tvmfuse.attention", dec) is ATTENTION_DECODE and lookup("tvmfuse.attention", pre) is ATTENTION_PREFILL
    assert ATTENTION_DECODE.check(dict(dec, dtype="float64")) == "decode template is fp16/bf16/fp32 only (got float64)"
    assert ATTENTION_PREFILL.check(dict(pre, dtype="float64")) == \
        "prefill template is fp16/bf16 only, fp32 on llvm (got float64)"


def _attention_module(mask: bool, kv_heads: int = 4, dt: str = "float16"):
    """softmax(Q K^T * 1/sqrt(d) [+ mask]) V in [B,H,S,D] fp16 (or `dt`), lowered by the fuse stage."""
    from tvmfuse.fuse.fusion import lower
    from tvmfuse.patterns import fusion_patterns
    bb = relax.BlockBuilder()
    q, k, v = (relax.Var(n, relax.TensorType((1, 4, 64, 64), dt)) for n in "qkv")
    params = [q, k, v] + ([relax.Var("m", relax.TensorType((1, 1, 64, 64), dt))] if mask else [])
    with bb.function("main", params):
        with bb.dataflow():
            s = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
            s = bb.emit(relax.op.multiply(s, relax.const(0.125, dt)))
            if mask:
                s = bb.emit(relax.op.add(s, params[3]))
            o = bb.emit_output(relax.op.matmul(bb.emit(relax.op.nn.softmax(s, axis=-1)), v))
        bb.emit_func_output(o)
    return lower(bb.get(), patterns=fusion_patterns(["tvmfuse.attention"]))


@pytest.mark.parametrize("mask", [True, False])
def test_substitute_replaces_attention_kernel(mask):
    fused = _attention_module(mask)
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.attention"]
    log = []
    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    assert [o for _, o in log] == ["template attention_prefill"], log
    rng = np.random.default_rng(3)
    args = [rand(rng, (1, 4, 64, 64), "float16") for _ in range(3)] + ([rand(rng, (1, 1, 64, 64), "float16")] if mask else [])
    got = relax.VirtualMachine(tvm.compile(new, target="llvm"), tvm.cpu())["main"](
        *[tvm.runtime.tensor(a) for a in args]).numpy().astype("f4")
    assert np.abs(got - ref(*args[:3], args[3] if mask else None)).max() < 2e-3


@pytest.mark.parametrize("mask_value", [0.0, -1.0])
def test_constant_zero_mask_is_no_mask(mask_value):
    """Exporters write a constant all-zero additive mask where none was given: it is dropped (the decode template
    runs without one); any other constant mask is kept and passed to the decode template, which adds it."""
    from checks import decode_attention

    fused = decode_attention(512, mask_value)
    log = []
    new = substitute(fused.mod, fused.kernel_patterns, target="cuda", log=log)
    if mask_value == 0.0:
        assert [o for _, o in log] == ["template attention_decode"], log
        call = [b.value for b in new["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)][-1]
        assert len(call.args[1].fields) == 3  # q, k, v: the zero mask is no longer passed
    else:
        assert [o for _, o in log] == ["template attention_decode"], log
        call = [b.value for b in new["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)][-1]
        assert len(call.args[1].fields) == 4  # q, k, v and the mask


def test_substitute_leaves_unknown_kernels():
    fused = _attention_module(False)
    log = []
    assert substitute(fused.mod, {}, log=log) is fused.mod and log == []
    name = next(iter(fused.kernel_patterns))
    same = substitute(fused.mod, fused.kernel_patterns, info={name: {"scale": -0.5}}, log=log)
    assert same is fused.mod and log[0][1] == "generic: softmax scale -0.5 is not a positive constant"


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
def test_gpu_matches_numpy():
    """On a GPU: both CUDA variants against numpy on small shapes."""
    dev, rng = tvm.cuda(0), np.random.default_rng(0)
    for tmpl, s, knobs, args in [
        (ATTENTION_DECODE, dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_k=512, head_dim=128, dtype="float16"),
         {"split": 4, "warps": 4, "unroll": 2}, [(2, 8, 1, 128), (2, 2, 512, 128), (2, 2, 512, 128)]),
        (ATTENTION_PREFILL, dict(batch=1, heads=4, kv_heads=2, seq_q=128, seq_k=128, head_dim=64, dtype="float16", causal=True),
         {"warps": 4, "block_n": 32}, [(1, 4, 128, 64), (1, 2, 128, 64), (1, 2, 128, 64)])]:
        arrs = [rand(rng, a, "float16") for a in args]
        lib = tvm.compile(tvm.IRModule({"main": tmpl(s, knobs)}), target=CUDA)
        out = tvm.runtime.tensor(np.zeros(args[0], "float16"), dev)
        lib["main"](*[tvm.runtime.tensor(a, dev) for a in arrs], out)
        assert np.abs(out.numpy().astype("f4") - ref(*arrs, causal=s.get("causal", False))).max() < 5e-3
    # decode over the exports' L = 513 keys (512 past + 1): guarded tails, empty splits (split 64), Q/out [B,1,H,D];
    # then the tiny GQA export's form: head_dim 16, the group in Q's rows, K/V read [B,L,H,D] in place
    for s, stored in [(dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_k=513, head_dim=128, dtype="float16",
                            q_layout="BSHD", out_layout="BSHD"), _bshd),
                      (dict(batch=2, heads=2, kv_heads=2, seq_q=2, seq_k=513, head_dim=16, dtype="float16",
                            k_layout="BSHD", v_layout="BSHD"), lambda x: x.reshape(2, 2, 2, 16))]:
        D, HQ = s["head_dim"], s["heads"] * s["seq_q"]  # q, k, v, ref: [B,H,S,D] with every query row a head
        q, k, v = rand(rng, (2, HQ, 1, D), "float16"), rand(rng, (2, 2, 513, D), "float16"), rand(rng, (2, 2, 513, D), "float16")
        args = [stored(q)] + [_bshd(x) if s.get("k_layout") == "BSHD" else x for x in (k, v)]
        for knobs in ({"split": 16, "warps": 4, "unroll": 2}, {"split": 64, "warps": 2, "unroll": 1},
                      {"split": 1, "warps": 8, "unroll": 4}, ATTENTION_DECODE.default_knobs(s)):
            lib = tvm.compile(tvm.IRModule({"main": ATTENTION_DECODE(s, knobs)}), target=CUDA)
            out = tvm.runtime.tensor(np.zeros(args[0].shape, "float16"), dev)
            lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
            assert np.abs(out.numpy().astype("f4") - stored(ref(q, k, v))).max() < 5e-3, (s, knobs)
    # the tiny exports' form: head_dim 16, Q/V/out BSHD read in place, K 2 heads, V 1, fp32 mask with a
    # fully masked (-inf) row (-> 0) and a finfo.min row (-> mean of V)
    s = dict(batch=1, heads=4, kv_heads=2, v_heads=1, seq_q=64, seq_k=64, head_dim=16, dtype="float16",
             mask="additive", mask_shape=(1, 1, 64, 64), mask_dtype="float32",
             q_layout="BSHD", k_layout="BHSD", v_layout="BSHD", out_layout="BSHD")
    q, k, v = rand(rng, (1, 4, 64, 16), "float16"), rand(rng, (1, 2, 64, 16), "float16"), rand(rng, (1, 1, 64, 16), "float16")
    mask = rng.standard_normal((1, 1, 64, 64)).astype("f4")
    mask[0, 0, 3, :] = -np.inf
    mask[0, 0, 9, :] = np.finfo(np.float32).min
    for knobs in ATTENTION_PREFILL.knob_space(s):
        lib = tvm.compile(tvm.IRModule({"main": ATTENTION_PREFILL(s, knobs)}), target=CUDA)
        out = tvm.runtime.tensor(np.zeros((1, 64, 4, 16), "float16"), dev)
        lib["main"](*[tvm.runtime.tensor(a, dev) for a in (_bshd(q), k, _bshd(v), mask)], out)
        got = out.numpy().astype("f4")
        assert np.abs(got[:, 3]).max() == 0, knobs
        assert np.abs(got - _bshd(ref(q, k, v, mask))).max() < 5e-3, knobs


def _bshd(x):
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def test_prefill_cpu_layouts_split_heads_and_fully_masked_rows():
    """Q/V/out stored BSHD (read in place), K BHSD, K with 2 heads and V with 1 (GQA); head_dim 16. A row
    masked with -inf everywhere gives 0 (the exports' isnan -> where guard); one masked with finfo.min
    (finite) gives the mean of V, as the graph's softmax does."""
    s = dict(batch=1, heads=4, kv_heads=2, v_heads=1, seq_q=64, seq_k=64, head_dim=16, dtype="float16",
             mask="additive", mask_shape=(1, 1, 64, 64), mask_dtype="float32",
             q_layout="BSHD", k_layout="BHSD", v_layout="BSHD", out_layout="BSHD")
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, (1, 4, 64, 16), "float16"), rand(rng, (1, 2, 64, 16), "float16"), rand(rng, (1, 1, 64, 16), "float16")
    mask = rng.standard_normal((1, 1, 64, 64)).astype("f4")
    mask[0, 0, 3, :] = -np.inf
    mask[0, 0, 9, :] = np.finfo(np.float32).min
    mask[0, 0, 12, 5:] = -np.inf
    got = run_cpu(ATTENTION_PREFILL(s, {"warps": 4, "block_n": 64}, "llvm"), [_bshd(q), k, _bshd(v), mask],
                  (1, 64, 4, 16), "float16")
    want = _bshd(ref(q, k, v, mask))
    assert np.abs(got[:, 3]).max() == 0
    assert np.abs(got[:, 9] - v.astype("f4").mean(2)[:, None, 0]).max() < 2e-3
    assert np.abs(got - want).max() < 2e-3
    assert ATTENTION_PREFILL.check(dict(s, dtype="float32")) is not None  # fp32 only for the CPU variant
    assert ATTENTION_PREFILL.check(dict(s, dtype="float32", target="llvm")) is None


def _export_like_module(dt: str = "float16", kv_heads: int = 2):
    """What the exports fuse: Q, K, V in [B,S,H,D] with the head permutes inside, the scale split in two
    (sqrt(1/sqrt(d)) into Q and into K^T), isnan -> where with a rank-1 zero, a GQA repeat of K and V inside,
    the output permuted back to [B,S,H,D]."""
    from tvmfuse.fuse.fusion import lower
    from tvmfuse.patterns import fusion_patterns
    bb, B, S, H, D = relax.BlockBuilder(), 1, 64, 4, 16
    q = relax.Var("q", relax.TensorType((B, S, H, D), dt))
    k = relax.Var("k", relax.TensorType((B, S, kv_heads, D), dt))
    v = relax.Var("v", relax.TensorType((B, S, kv_heads, D), dt))
    m = relax.Var("m", relax.TensorType((B, 1, S, S), dt))
    half = relax.const(float(D) ** -0.25, dt)

    def heads(x):  # [B,S,KV,D] -> [B,H,S,D]: permute, then repeat_kv
        x = bb.emit(relax.op.permute_dims(x, [0, 2, 1, 3]))
        if kv_heads == H:
            return x
        x = bb.emit(relax.op.expand_dims(x, [2]))
        x = bb.emit(relax.op.broadcast_to(x, relax.ShapeExpr([B, kv_heads, H // kv_heads, S, D])))
        return bb.emit(relax.op.reshape(x, relax.ShapeExpr([B, H, S, D])))

    with bb.function("main", [q, k, v, m]):
        with bb.dataflow():
            qh = bb.emit(relax.op.multiply(bb.emit(relax.op.permute_dims(q, [0, 2, 1, 3])), half))
            kt = bb.emit(relax.op.multiply(bb.emit(relax.op.permute_dims(heads(k), [0, 1, 3, 2])), half))
            s = bb.emit(relax.op.add(bb.emit(relax.op.matmul(qh, kt)), m))
            p = bb.emit(relax.op.nn.softmax(s, axis=-1))
            p = bb.emit(relax.op.where(relax.op.isnan(p), relax.const(np.zeros(1, dt), dt), p))
            o = bb.emit_output(relax.op.permute_dims(bb.emit(relax.op.matmul(p, heads(v))), [0, 2, 1, 3]))
        bb.emit_func_output(o)
    return lower(bb.get(), patterns=fusion_patterns(["tvmfuse.attention"]))


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_substitute_takes_the_export_form(kv_heads):
    """BSHD in and out, split scale, rank-1 where guard, GQA repeat inside, fp16: the template takes it."""
    fused = _export_like_module(kv_heads=kv_heads)
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.attention"], fused.rejections
    log = []
    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    assert [o for _, o in log] == ["template attention_prefill"], log
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, (1, 64, 4, 16), "float16"), rand(rng, (1, 64, kv_heads, 16), "float16"), \
        rand(rng, (1, 64, kv_heads, 16), "float16")
    mask = np.where(np.tril(np.ones((64, 64), bool)), 0, -np.inf).astype("float16")[None, None]
    mask[..., 7, :] = -np.inf  # a fully masked row: 0 from the graph's guard and from the template
    got = relax.VirtualMachine(tvm.compile(new, target="llvm"), tvm.cpu())["main"](
        *[tvm.runtime.tensor(a) for a in (q, k, v, mask)]).numpy().astype("f4")
    want = _bshd(ref(_bshd(q), _bshd(k), _bshd(v), mask))
    assert np.abs(got[:, 7]).max() == 0 and np.abs(got - want).max() < 2e-3


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma2"])
def test_hf_fp16_export_builds_for_cuda_with_the_template(name, hf_exports, tmp_path, capsys):
    """The product path (`tune --target cuda --dtype fp16 --trials 0`, compile only): the job log says the
    attention kernel was replaced by the prefill template, and the export has one attention kernel. GPT-2's reads
    Q, K and V from c_attn's output (`kernels/split_reads.py`): its line says so and no split kernel is left."""
    import json
    from tvmfuse.cli.tune import main

    out = tmp_path / "out"
    rc = main([hf_exports(name, "legacy"), "--target", "cuda", "--trials", "0", "--dtype", "fp16",
               "--shape", "batch=1", "--shape", "seq=64", "--out", str(out), "--logs", str(tmp_path / "logs"),
               "--schedules", "none"])
    assert rc == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "attention" in ln and "template" in ln]
    assert len(lines) == 1 and ": template attention_prefill" in lines[0], lines
    (folder,) = os.listdir(out)
    with open(out / folder / "manifest.json", encoding="utf-8") as f:
        manifest = json.load(f)
    assert [k["pattern"] for k in manifest["kernels"]].count("tvmfuse.attention") == 1
    assert manifest["precision"]["compute_dtype"] == "float16"
    if name == "gpt2":
        assert lines[0].endswith("; Q, K and V read in place from the split's input (rows of 192, at 0, 64, 128): "
                                 "no split launched"), lines
        assert not [k["name"] for k in manifest["kernels"] if "split" in k["name"]], manifest["kernels"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_cuda_variant_compiles_at_export_shapes():
    """The tiny exports' attention (batch 1, seq 64, 4 heads of 16, K/V heads 2 or 4, fp32 mask) in their
    layouts compiles with nvcc."""
    base = dict(batch=1, heads=4, seq_q=64, seq_k=64, head_dim=16, dtype="float16", mask="additive",
                mask_shape=(1, 1, 64, 64), mask_dtype="float32")
    for lay in (dict(kv_heads=4, q_layout="BSHD", k_layout="BSHD", v_layout="BSHD", out_layout="BHSD"),  # gpt2 legacy
                dict(kv_heads=4, v_heads=2, q_layout="BHSD", k_layout="BHSD", v_layout="BSHD", out_layout="BSHD")):
        s = {**base, **lay}
        assert lookup("tvmfuse.attention", s) is ATTENTION_PREFILL
        src = _cuda_compiles(ATTENTION_PREFILL(s, ATTENTION_PREFILL.default_knobs(s)))
        assert "mma.sync.aligned.m16n8k16" in src and "CUDART_INF_F" in src  # the fully-masked-row test


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma2"])
def test_hf_exports_take_the_prefill_template(name, exporter, hf_exports, llvm):
    """Tiny GPT-2/Llama exports at batch 1, seq 64, the pipeline's order (bind_params -> to_compute_dtype(fp16)
    -> decide -> lower(plan)): the fp16 attention (casts between its ops, fp32 softmax) is one kernel, and
    substitute(target='llvm') takes every attention kernel, and the built module matches onnxruntime within
    fp16's tolerance, also with left padding (rows with no visible key)."""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    import onnxruntime as ort
    from tvmfuse.build.compile import build
    from tvmfuse.decide.decision import decide
    from tvmfuse.fuse.fusion import lower
    from tvmfuse.prepare import bind_params
    from tvmfuse.frontend.importer import import_model, load_onnx
    from tvmfuse.prepare.precision import to_compute_dtype

    model = load_onnx(hf_exports(name, exporter))
    imp = import_model(model, {"batch": [1], "seq": [64]})
    tol = 1e-2
    bound = to_compute_dtype(bind_params(imp.mod, imp.params), "float16")
    fused = lower(bound, plan=decide(bound))
    attention = [k for k, p in fused.kernel_patterns.items() if p == "tvmfuse.attention"]
    assert len(attention) == 1, fused.rejections  # both layers' attention: one shared PrimFunc
    log = []
    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    assert sorted(k for k, _ in log) == sorted(attention) and {o for _, o in log} == {"template attention_prefill"}, log
    vm = relax.VirtualMachine(build(new, llvm)[0], tvm.cpu())
    sess = ort.InferenceSession(model.SerializeToString())
    ids = np.random.default_rng(0).integers(0, 128, (1, 64)).astype("int64")
    for pad in (0, 5):
        am = (np.arange(64) >= pad).astype("int64")[None]
        got = vm["main"](tvm.runtime.tensor(ids), tvm.runtime.tensor(am)).numpy()
        want = sess.run(None, {"input_ids": ids, "attention_mask": am})[0]
        assert np.all(np.abs(got - want) <= tol + tol * np.abs(want)), (pad, np.abs(got - want).max())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_cuda_prefill_pipelined_variants_compile():
    """The knobs beyond the first form: cp.async double-buffered K/V (stages 2; with the Q tile 102 KiB, so
    dynamic shared memory), two 16-row m-tiles per warp sharing each K/V fragment (m_tiles 2) and Q read
    from shared memory by ldmatrix (q_smem) compile with nvcc."""
    pre = dict(batch=1, heads=32, kv_heads=8, seq_q=256, seq_k=256, head_dim=128, dtype="float16", causal=True)
    space = ATTENTION_PREFILL.knob_space(pre)
    knobs = {"warps": 4, "block_n": 64, "m_tiles": 2, "stages": 2, "q_smem": 1}  # FlashAttention-2's tiling
    assert knobs in space and {"warps": 4, "block_n": 32, "m_tiles": 1, "stages": 2} in space
    assert {k["stages"] for k in space} == {1, 2} and {k["m_tiles"] for k in space} == {1, 2}
    assert {k.get("q_smem") for k in space} == {None, 0, 1}
    src = _cuda_compiles(ATTENTION_PREFILL(pre, knobs))
    assert "cp_async_cg" in src and "wait_group_1" in src and "extern __shared__" in src
    assert src.count("mma.sync.aligned.m16n8k16") >= 1
    mask = dict(pre, head_dim=64, causal=False, mask="additive", mask_shape=(1, 1, 256, 256))
    src = _cuda_compiles(ATTENTION_PREFILL(mask, {"warps": 4, "block_n": 32, "m_tiles": 1, "stages": 2}))
    assert "cp_async_cg" in src and "extern __shared__" not in src  # 18 KiB: static shared memory
    assert src.count("__syncthreads_or(") == 2  # the tile's mask block: all -inf (skip it), all 0 (not read)


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
@pytest.mark.parametrize("variant", ["causal128", "mask64_gqa", "causalmask64"])
def test_gpu_prefill_every_knob_set_matches_numpy(variant):
    """On a GPU: every knob set of the prefill template (stages, m_tiles, warps, block_n) against numpy; with a
    causal -inf mask (as the exports build it) the tiles above the diagonal skip their math, those below read no
    mask (their block is all 0 but for the random values kept on the diagonal tiles)."""
    dev, rng = tvm.cuda(0), np.random.default_rng(1)
    D, KV = (128, 4) if variant == "causal128" else (64, 2)
    s = dict(batch=1, heads=4, kv_heads=KV, seq_q=256, seq_k=256, head_dim=D, dtype="float16",
             causal=variant == "causal128", mask="additive" if variant != "causal128" else "none",
             mask_shape=(1, 1, 256, 256))
    q, k, v = rand(rng, (1, 4, 256, D), "float16"), rand(rng, (1, KV, 256, D), "float16"), rand(rng, (1, KV, 256, D), "float16")
    mask = (rng.standard_normal((1, 1, 256, 256)) * 2).astype("float16")
    if variant == "causalmask64":
        rows, cols = np.indices((256, 256))
        mask = np.where(cols > rows, -np.inf, np.where(rows // 64 == cols // 64, mask, 0)).astype("float16")
    args = [q, k, v] + ([mask] if s["mask"] == "additive" else [])
    want = ref(q, k, v, mask if s["mask"] == "additive" else None, s["causal"])
    for knobs in ATTENTION_PREFILL.knob_space(s):
        lib = tvm.compile(tvm.IRModule({"main": ATTENTION_PREFILL(s, knobs)}), target=CUDA)
        out = tvm.runtime.tensor(np.zeros(q.shape, "float16"), dev)
        lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
        assert np.abs(out.numpy().astype("f4") - want).max() < 5e-3, knobs


@pytest.mark.parametrize("batch, kv_heads, mask, want", [
    (16, 32, "additive", {"split": 4, "warps": 8, "unroll": 2}),  # attention_run4: 135 us (split 1: 260)
    (1, 32, "additive", {"split": 16, "warps": 8, "unroll": 2}),  # 10.2 us (4 warps x 4: 12.6)
    (16, 32, None, {"split": 4, "warps": 4, "unroll": 4}),        # 129 us (split 1: 225)
    (16, 8, "additive", {"split": 4, "warps": 8, "unroll": 2}),   # GQA: the cap counts query heads (not split 16)
])
def test_decode_defaults_for_a_symbolic_kv_length(batch, kv_heads, mask, want):
    """A decoder's in-place cache (symbolic KV length, fp32 mask [B, 1, 1, L]): the split that keeps more than one
    wave of blocks, as measured on the H200; the static length's rule (2 blocks per SM) is unchanged."""
    s = dict(batch=batch, heads=32, kv_heads=kv_heads, seq_q=1, seq_k="past + 1", head_dim=128, dtype="float16",
             k_layout="SBHD", v_layout="SBHD", mask=mask,
             **({"mask_shape": (batch, 1, 1, "past + 1"), "mask_dtype": "float32"} if mask else {}))
    assert ATTENTION_DECODE.default_knobs(s) == want and want in ATTENTION_DECODE.knob_space(s)
    static = dict(s, seq_k=2048, mask=None)
    static.pop("mask_shape", None)
    if kv_heads == 32:
        assert ATTENTION_DECODE.default_knobs(static)["split"] == (1 if batch == 16 else 16)


@pytest.mark.parametrize("L", [513, 100])
def test_decode_cpu_any_kv_length(L):
    """KV length that no split x step count divides (the decode exports' 512 past keys + 1): each split takes
    ceil(L / split) keys rounded up to whole steps, keys from L on weigh nothing, splits with no key at all
    (split 64) combine to nothing; GQA (8 query heads over 2 KV heads), Q and out stored [B,1,H,D] (BSHD)."""
    s = dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_k=L, head_dim=64, dtype="float16", q_layout="BSHD",
             out_layout="BSHD")
    space = ATTENTION_DECODE.knob_space(s)
    assert {k["split"] for k in space} == {1, 4, 8, 16, 32, 64} and ATTENTION_DECODE.default_knobs(s) in space
    rng = np.random.default_rng(L)
    q, k, v = rand(rng, (2, 8, 1, 64), "float16"), rand(rng, (2, 2, L, 64), "float16"), rand(rng, (2, 2, L, 64), "float16")
    want = _bshd(ref(q, k, v))
    for knobs in ({"split": 4, "warps": 4, "unroll": 2}, {"split": 64, "warps": 2, "unroll": 1}):
        live = -(-L // chunk_of(s, knobs))  # splits with keys: split 64 leaves 31 (L=513) or 51 (L=100) empty
        assert (live < knobs["split"]) == (knobs["split"] == 64) and chunk_of(s, knobs) * knobs["split"] > L
        got = run_cpu(ATTENTION_DECODE(s, knobs, "llvm"), [_bshd(q), k, v], (2, 1, 8, 64), "float16")
        assert np.abs(got - want).max() < 2e-3, knobs


def test_decode_cpu_group_rows_and_bshd_kv():
    """transformers' GQA decode passes Q as [B, kv_heads, G, D] (the group in the rows): with no mask each row
    is one more query head; K and V stored [B,L,H,D] are read in place; head_dim 16 (the tiny exports')."""
    s = dict(batch=2, heads=2, kv_heads=2, seq_q=4, seq_k=513, head_dim=16, dtype="float16", k_layout="BSHD",
             v_layout="BSHD")
    rng = np.random.default_rng(2)
    q, k, v = rand(rng, (2, 2, 4, 16), "float16"), rand(rng, (2, 2, 513, 16), "float16"), rand(rng, (2, 2, 513, 16), "float16")
    got = run_cpu(ATTENTION_DECODE(s, {"split": 8}, "llvm"), [q, _bshd(k), _bshd(v)], q.shape, "float16")
    assert np.abs(got - ref(q.reshape(2, 8, 1, 16), k, v).reshape(q.shape)).max() < 2e-3
    assert "one query token" in ATTENTION_DECODE.check(dict(s, seq_q=64))  # prefill rows: not a group
    assert "one query token" in ATTENTION_DECODE.check(dict(s, causal=True, seq_k=4))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_cuda_decode_compiles_with_guards_only_where_needed():
    """L = 513: the keys past L are guarded (loads and scores); L = 512 with split x chunk == L has no guard."""
    s = dict(batch=1, heads=32, kv_heads=8, seq_q=1, seq_k=513, head_dim=128, dtype="float16", q_layout="BSHD")
    knobs = {"split": 16, "warps": 4, "unroll": 2}
    src = _cuda_compiles(ATTENTION_DECODE(s, knobs))
    assert "< 513)" in src and "-3.000000e+38" in src and "uint4" in src
    src = _cuda_compiles(ATTENTION_DECODE(dict(s, seq_k=512), knobs))
    assert "< 512)" not in src and "-3.000000e+38" not in src


def _decode_export(name: str, folder: str) -> str:
    """bench/hf_models.py's decode export of a tiny GPT-2 / Llama (Llama with 2 KV heads for 4 query heads:
    GQA) at batch 2 with 512 past tokens, so attention runs over 513 keys."""
    import sys

    import torch
    import transformers as tf

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import hf_models as hm  # pylint: disable=import-outside-toplevel

    path = os.path.join(folder, f"{name}_decode.onnx")
    if not os.path.exists(path):
        cfg = hm.config(name, smoke=True)
        cfg.update({"n_positions": 1024} if name == "gpt2" else {"max_position_embeddings": 1024, "num_key_value_heads": 2})
        cfg._attn_implementation = "sdpa"  # pylint: disable=protected-access
        torch.manual_seed(0)
        model = (tf.GPT2LMHeadModel if name == "gpt2" else tf.LlamaForCausalLM)(cfg).eval()
        hm.export(hm.wrap(model, "decode_b2"), hm.inputs(name, model, {"batch": 2, "seq": 1, "kv_len": 512}), path)
    return path


@pytest.fixture(scope="module")
def decode_exports(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = str(tmp_path_factory.mktemp("hf_decode"))
    return lambda name: _decode_export(name, folder)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_decode_export_builds_for_cuda_with_the_decode_template(name, decode_exports, tmp_path, capsys):
    """The product path for bench/models.py's decode exports (KV 512 + 1, fp16, `--trials 0`, compiled with
    nvcc): every attention kernel is the decode template."""
    import json

    from tvmfuse.cli.tune import main

    out = tmp_path / "out"
    rc = main([decode_exports(name), "--target", "cuda", "--trials", "0", "--dtype", "fp16", "--out", str(out),
               "--logs", str(tmp_path / "logs"), "--schedules", "none"])
    assert rc == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "attention" in ln and (": template" in ln or ": generic" in ln)]
    assert lines and all(": template attention_decode" in ln for ln in lines), lines
    (folder,) = os.listdir(out)
    with open(out / folder / "manifest.json", encoding="utf-8") as f:
        manifest = json.load(f)
    assert [k["pattern"] for k in manifest["kernels"]].count("tvmfuse.attention") == len(lines) == 1  # layers share it


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_decode_exports_match_onnxruntime_with_the_decode_template(name, decode_exports, llvm):
    """The tiny decode exports in fp16 (the pipeline's order), attention substituted by the decode template on
    llvm: logits and the new K/V match onnxruntime within fp16's tolerance."""
    import onnxruntime as ort

    from tvmfuse.build.compile import build
    from tvmfuse.decide.decision import decide
    from tvmfuse.fuse.fusion import lower
    from tvmfuse.prepare import bind_params
    from tvmfuse.frontend.importer import import_model, load_onnx
    from tvmfuse.prepare.precision import to_compute_dtype

    model = load_onnx(decode_exports(name))
    imp = import_model(model, {})
    bound = to_compute_dtype(bind_params(imp.mod, imp.params), "float16")
    fused = lower(bound, plan=decide(bound))
    attention = [k for k, p in fused.kernel_patterns.items() if p == "tvmfuse.attention"]
    log = []
    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    assert attention and sorted(k for k, _ in log) == sorted(attention), log
    assert {o for _, o in log} == {"template attention_decode"}, log
    rng = np.random.default_rng(0)
    feeds = {i.name: (rng.integers(0, 128, (2, 1)) if i.name == "input_ids" else rng.standard_normal(
        [d.dim_value for d in i.type.tensor_type.shape.dim])).astype("int64" if i.name == "input_ids" else "float32")
        for i in model.graph.input}
    got = relax.VirtualMachine(build(new, llvm)[0], tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in feeds.values()])
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert np.all(np.abs(g.numpy() - w) <= 1e-2 + 1e-2 * np.abs(w)), np.abs(g.numpy() - w).max()


@pytest.fixture(scope="module")
def gpt2_prefill(tmp_path_factory):
    """bench/hf_models.py's prefill export (the prefill_512 wrapping) of a small GPT-2 (128 wide, 2 layers, 2 heads
    of 64) at batch 1, seq 64."""
    pytest.importorskip("transformers")
    import sys

    import torch
    import transformers as tf

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import hf_models as hm  # pylint: disable=import-outside-toplevel

    path = str(tmp_path_factory.mktemp("gpt2_prefill") / "gpt2.onnx")
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_embd=128, n_layer=2, n_head=2, n_positions=128, vocab_size=128)
    cfg._attn_implementation = "sdpa"  # pylint: disable=protected-access
    model = tf.GPT2LMHeadModel(cfg).eval()
    hm.export(hm.wrap(model, "prefill_512"), hm.inputs("gpt2", model, {"batch": 1, "seq": 64, "kv_len": 0}), path)
    return path


def test_gpt2_head_merge_is_in_the_attention_kernel(gpt2_prefill):
    """fp16 for CUDA (prepare_module, decide, lower): the head merge after attention (permute [0,2,1,3]; the
    same-shape reshape before it the prepare stage drops) is in the attention kernel, so no transpose kernel runs
    between attention and the output projection (only the [B,S,H*D] reshape, a view); the roles read out as BSHD and
    the prefill template takes it."""
    from tvmfuse.decide.decision import decide
    from tvmfuse.fuse.fusion import lower
    from tvmfuse.frontend.importer import import_model, load_onnx
    from tvmfuse.kernels.substitution import template_sites
    from tvmfuse.kernels.attention.roles import attention_roles
    from tvmfuse.prepare import prepare_module
    from tvmfuse.targets import resolve_target

    bound = prepare_module(import_model(load_onnx(gpt2_prefill), {}), "fp16")
    fused = lower(bound, plan=decide(bound, resolve_target("cuda")))
    (att,) = [k for k, p in fused.kernel_patterns.items() if p == "tvmfuse.attention"]
    assert att.endswith("relax_matmul_relax_astype_relax_permute_dims"), att
    names = [gv.name_hint for gv, f in fused.mod.functions.items() if gv.name_hint != "main"]
    assert not [n for n in names if "transpose" in n], names
    calls = [b.value for blk in fused.mod["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]
    seq = [c.args[0].name_hint for c in calls]
    for i in [i for i, n in enumerate(seq) if n == att]:  # up to the next matmul: only reshapes
        j = next(j for j in range(i + 1, len(seq)) if "matmul" in seq[j])
        assert all(seq[x].startswith(("reshape", "fused_reshape")) and "transpose" not in seq[x]
                   for x in range(i + 1, j)), seq[i:j + 1]
    assert seq.count(att) == 2  # both layers
    shapes = attention_roles(fused.mod[att])["shapes"]
    assert shapes["out_layout"] == "BSHD" and shapes["q_layout"] == "BSHD", shapes
    log = []
    sites = template_sites(fused.mod, fused.kernel_patterns, target="cuda", log=log)
    assert [(s[1], s[2].name) for s in sites] == [(att, "attention_prefill")], (sites, log)


def test_gpt2_head_merge_build_verifies_on_llvm(gpt2_prefill, llvm, tmp_path):
    """The product path on llvm (fp32, no tuning): the build with the head merge inside attention passes the
    verification against onnxruntime."""
    from tvmfuse.jobs import Job
    from tvmfuse.pipeline import run_job

    said = []
    result = run_job(Job("gpt2", gpt2_prefill, trials=0, dtype="float32"), llvm, str(tmp_path / "out"),
                     str(tmp_path / "logs"), say=said.append, schedules=None)
    assert result.ok, (result.error, said)
    assert result.verification.startswith("ok"), result.verification
    import json

    with open(os.path.join(result.output, "manifest.json"), encoding="utf-8") as f:
        kernels = [k["name"] for k in json.load(f)["kernels"]]
    att = [k for k in kernels if "softmax" in k]
    assert len(att) == 1 and att[0].endswith("relax_matmul_relax_permute_dims"), kernels
    assert not [k for k in kernels if "transpose" in k], kernels


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_cuda_bf16_variants_compile_for_sm_90a():
    """bf16 decode (16-byte loads of 8 bf16, guarded L = 513, the GQA group in Q's rows with BSHD K/V) and bf16
    prefill (mma.sync .bf16 with ldmatrix; cp.async double buffering, 2 m-tiles, Q from shared memory; a bf16
    and an fp32 additive mask) compile with nvcc for sm_90a, the arch `--target cuda` builds for."""
    dec = dict(batch=16, heads=32, kv_heads=8, seq_q=1, seq_k=4096, head_dim=128, dtype="bfloat16")
    for s in (dec, dict(dec, seq_k=513, q_layout="BSHD"),
              dict(batch=2, heads=2, kv_heads=2, seq_q=2, seq_k=513, head_dim=16, dtype="bfloat16",
                   k_layout="BSHD", v_layout="BSHD")):
        assert ATTENTION_DECODE.check(s) is None
        src = _cuda_compiles(ATTENTION_DECODE(s, ATTENTION_DECODE.default_knobs(s)), H100)
        kernels = "".join(src.split("__global__")[1:])  # the split pass and the combine
        assert "#include <cuda_bf16.h>" in src and "nv_bfloat16* __restrict__ k_ptr" in kernels
        assert "= *(uint4*)(k_ptr + " in kernels and "half" not in kernels  # 16-byte loads of 8 bf16 keys
    pre = dict(batch=1, heads=32, kv_heads=8, seq_q=256, seq_k=256, head_dim=128, dtype="bfloat16", causal=True)
    src = _cuda_compiles(ATTENTION_PREFILL(pre, {"warps": 4, "block_n": 64, "m_tiles": 2, "stages": 2, "q_smem": 1}), H100)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src and "ldmatrix" in src and "cp_async_cg" in src
    assert ".f16.f16" not in src
    for mdt in ("bfloat16", "float32"):
        mask = dict(pre, head_dim=64, causal=False, mask="additive", mask_shape=(1, 1, 256, 256), mask_dtype=mdt)
        src = _cuda_compiles(ATTENTION_PREFILL(mask, {"warps": 4, "block_n": 32, "m_tiles": 1, "stages": 2}), H100)
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src and src.count("__syncthreads_or(") == 2


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_bf16_attention_kernels_take_the_templates_and_compile_for_sm_90a():
    """The fused bf16 attention of decode and prefill (with and without a mask) is replaced by its template on
    CUDA, and the built module compiles with nvcc for sm_90a."""
    from checks import cuda_sources, decode_attention

    from tvmfuse.build.compile import apply_default_schedules, compile_module
    from tvmfuse.targets import resolve_target

    cuda = resolve_target("cuda")
    for fused, template in [(decode_attention(512, None, "bfloat16"), "attention_decode"),
                            (_attention_module(False, dt="bfloat16"), "attention_prefill"),
                            (_attention_module(True, dt="bfloat16"), "attention_prefill")]:
        assert list(fused.kernel_patterns.values()) == ["tvmfuse.attention"], fused.rejections
        log = []
        new = substitute(fused.mod, fused.kernel_patterns, target="cuda", log=log)
        assert [o for _, o in log] == [f"template {template}"], log
        srcs = cuda_sources(compile_module(apply_default_schedules(new, cuda), cuda))
        assert len(srcs) == 1 and "nv_bfloat16" in srcs[0]
        assert ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in srcs[0]) == (template == "attention_prefill")
        with cuda:
            assert len(tvm.support.nvcc.compile_cuda(srcs[0], "fatbin", compiler="nvcc")) > 1000


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
def test_gpu_bf16_matches_numpy():
    """On a GPU, bf16: decode (several knob sets, L = 513 guarded, BSHD Q/out) and every prefill knob set (causal
    hd 128; additive fp32 mask with a fully masked row) against numpy on the bf16 inputs. Tolerance: the output
    rounded to bf16 (2^-9 of |out| <= ~4) plus P rounded to bf16 before P V (the CPU variant: 7e-3)."""
    dev, rng, dt = tvm.cuda(0), np.random.default_rng(0), "bfloat16"
    s = dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_k=513, head_dim=128, dtype=dt, q_layout="BSHD",
             out_layout="BSHD")
    q, k, v = rand(rng, (2, 8, 1, 128), dt), rand(rng, (2, 2, 513, 128), dt), rand(rng, (2, 2, 513, 128), dt)
    want = _bshd(ref(q, k, v))
    for knobs in ({"split": 16, "warps": 4, "unroll": 2}, {"split": 64, "warps": 2, "unroll": 1},
                  {"split": 1, "warps": 8, "unroll": 4}, ATTENTION_DECODE.default_knobs(s)):
        lib = tvm.compile(tvm.IRModule({"main": ATTENTION_DECODE(s, knobs)}), target=H100)
        out = tvm.runtime.tensor(np.zeros((2, 1, 8, 128), dt), dev)
        lib["main"](*[tvm.runtime.tensor(a, dev) for a in (_bshd(q), k, v)], out)
        got = out.numpy()
        assert str(got.dtype) == dt and np.abs(got.astype("f4") - want).max() < 2e-2, knobs
    s = dict(batch=1, heads=4, kv_heads=4, seq_q=256, seq_k=256, head_dim=128, dtype=dt, causal=True)
    q, k, v = rand(rng, (1, 4, 256, 128), dt), rand(rng, (1, 4, 256, 128), dt), rand(rng, (1, 4, 256, 128), dt)
    want = ref(q, k, v, causal=True)
    for knobs in ATTENTION_PREFILL.knob_space(s):
        lib = tvm.compile(tvm.IRModule({"main": ATTENTION_PREFILL(s, knobs)}), target=H100)
        out = tvm.runtime.tensor(np.zeros(q.shape, dt), dev)
        lib["main"](*[tvm.runtime.tensor(a, dev) for a in (q, k, v)], out)
        assert np.abs(out.numpy().astype("f4") - want).max() < 3e-2, knobs
    s = dict(batch=1, heads=4, kv_heads=2, seq_q=64, seq_k=64, head_dim=64, dtype=dt, mask="additive",
             mask_shape=(1, 1, 64, 64), mask_dtype="float32")
    q, k, v = rand(rng, (1, 4, 64, 64), dt), rand(rng, (1, 2, 64, 64), dt), rand(rng, (1, 2, 64, 64), dt)
    mask = (rng.standard_normal((1, 1, 64, 64)) * 2).astype("f4")
    mask[0, 0, 3, :] = -np.inf
    want = ref(q, k, v, mask)
    for knobs in ATTENTION_PREFILL.knob_space(s):
        lib = tvm.compile(tvm.IRModule({"main": ATTENTION_PREFILL(s, knobs)}), target=H100)
        out = tvm.runtime.tensor(np.zeros(q.shape, dt), dev)
        lib["main"](*[tvm.runtime.tensor(a, dev) for a in (q, k, v, mask)], out)
        got = out.numpy().astype("f4")
        assert np.abs(got[:, :, 3]).max() == 0, knobs  # the fully masked row
        assert np.abs(got - want).max() < 3e-2, knobs


def _cache_case(rng, batch, past, seq, kv_heads=2, heads=4, dim=16):
    """Q [B,H,S,D] fp32 (a rotary in fp32), K/V [P+S,B,KV,D] fp16 as an in-place cache's view holds them, and a
    causal additive mask [B,1,S,P+S] with two -inf keys in row 0 of batch 0 and (past > 0) batch 1's last query
    row fully masked; with the numpy reference output [B,S,H,D]."""
    L = past + seq
    q = rng.standard_normal((batch, heads, seq, dim)).astype("f4")
    k, v = (rng.standard_normal((L, batch, kv_heads, dim)).astype("f2") for _ in "kv")
    mask = np.where(np.arange(L)[None, :] <= past + np.arange(seq)[:, None], 0, -np.inf).astype("f4")
    mask = np.repeat(mask[None, None], batch, 0)
    if L > 2:
        mask[0, 0, 0, :2] = -np.inf
    if past and batch > 1:
        mask[1, 0, -1, :] = -np.inf
    want = ref(q.astype("f2"), k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3), mask).transpose(0, 2, 1, 3)
    return [q, k, v, mask], want


CACHE_STEP = dict(batch="batch", heads=4, kv_heads=2, seq_q="seq", seq_k="past + seq", head_dim=16, dtype="float16",
                  q_dtype="float32", k_layout="SBHD", v_layout="SBHD", out_layout="BSHD", mask="additive",
                  mask_shape=("batch", 1, "seq", "past + seq"), mask_dtype="float32")
#: (batch, past, seq) of the step checks: the prompt at past 0, decode after pasts of several lengths (a split
#: with keys past L, empty splits), a prefill after a past, one token at past 0
CACHE_STEPS = [(2, 0, 7), (1, 5, 1), (2, 100, 1), (2, 600, 1), (2, 37, 20), (1, 0, 1), (2, 0, 70)]


def _run_step(lib, args, want, dev=None):
    dev = dev or tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(want.shape, "f2"), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
    return out.numpy().astype("f4")


def test_step_template_cpu_reads_the_cache_view_at_every_length():
    """The step template (symbolic batch, seq and past + seq; K/V SBHD as the in-place cache's view; fp32 Q; GQA;
    an additive mask with a fully masked row) compiled once on llvm matches numpy at every (batch, past, seq):
    its one-token branch (flash decoding) and its prefill branch; the fully masked row is 0."""
    from tvmfuse.kernels import ATTENTION_STEP

    assert lookup("tvmfuse.attention", CACHE_STEP) is ATTENTION_STEP
    lib = tvm.compile(tvm.IRModule({"main": ATTENTION_STEP(CACHE_STEP, target="llvm")}), target="llvm")
    rng = np.random.default_rng(11)
    for batch, past, seq in CACHE_STEPS:
        args, want = _cache_case(rng, batch, past, seq)
        got = _run_step(lib, args, want)
        assert np.abs(got - want).max() < 2e-3, (batch, past, seq)
        if past and batch > 1:
            assert np.abs(got[1, -1]).max() == 0


def test_decode_cpu_takes_the_cache_view_and_a_mask():
    """The decode template at one token with a symbolic KV length over SBHD K/V and an additive mask (what a
    seq=1 bucket of the in-place step passes) matches numpy at several lengths, one kernel for all."""
    s = dict(CACHE_STEP, seq_q=1, mask_shape=("batch", 1, 1, "past + seq"))
    assert ATTENTION_DECODE.check(s) is None
    lib = tvm.compile(tvm.IRModule({"main": ATTENTION_DECODE(s, {"split": 4}, "llvm")}), target="llvm")
    rng = np.random.default_rng(12)
    for batch, past in ((1, 0), (2, 5), (2, 300)):
        args, want = _cache_case(rng, batch, past, 1)
        assert np.abs(_run_step(lib, args, want) - want).max() < 2e-3, (batch, past)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_cuda_cache_view_kernels_compile_guarded():
    """The decode template over the cache's view with a symbolic KV length guards its keys (loads, scores and
    mask reads) and reads the mask one value at a time; the step template holds both branches; both compile with
    nvcc for sm_90a (bf16 too)."""
    from tvmfuse.kernels import ATTENTION_STEP

    for dt in ("float16", "bfloat16"):
        s = dict(CACHE_STEP, seq_q=1, mask_shape=("batch", 1, 1, "past + seq"), dtype=dt)
        src = _cuda_compiles(ATTENTION_DECODE(s, ATTENTION_DECODE.default_knobs(s)), H100)
        assert "< seq_k)" in src and "-3.000000e+38" in src and "uint4" in src and "CUDART_INF_F" in src
        src = _cuda_compiles(ATTENTION_STEP(dict(CACHE_STEP, dtype=dt)), H100)
        assert src.count('extern "C" __global__') == 6  # declared and defined: split, combine, prefill
        assert "mma.sync.aligned.m16n8k16" in src and "__shfl_xor_sync" in src and "__syncthreads_or(" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_cache_view_kernels_at_llama_7b_heads_compile_through_the_build_pipeline(dt):
    """Llama-2-7B's heads (32 of 128) over the cache's view with a symbolic batch: lowered as the build lowers
    them (its TIR pipeline: these kernels without TIR's CSE), every K/V load is one 16-byte load and nvcc compiles
    them. With CSE, `batch * 65536` went into a kernel argument, the third load lost its proven alignment and TVM
    emitted 8 halves into make_uint4, which nvcc rejects (the 8-layer generation bench's build failed so)."""
    from tvmfuse.build.compile import TIR_PIPELINE
    from tvmfuse.kernels import ATTENTION_STEP
    from tvmfuse.kernels.attention.common import NO_CSE_ATTR

    base = dict(CACHE_STEP, heads=32, kv_heads=32, head_dim=128, dtype=dt)
    one = dict(base, seq_q=1, mask_shape=("batch", 1, 1, "past + seq"))
    unroll = ATTENTION_DECODE.default_knobs(one)["unroll"]  # K loads per step of keys in flight
    for fn in (ATTENTION_DECODE(one, ATTENTION_DECODE.default_knobs(one)), ATTENTION_STEP(base)):
        assert fn.attrs[NO_CSE_ATTR]
        ex = tvm.compile(tvm.IRModule({"main": fn}), target=H100, tir_pipeline=TIR_PIPELINE)
        src = ex.mod.imports[0].inspect_source("cuda")
        assert "make_uint4(k_ptr[" not in src and "make_uint4(v_ptr[" not in src
        assert src.count("= *(uint4*)(k_ptr + ") >= unroll
        with H100:
            assert len(tvm.support.nvcc.compile_cuda(src, "fatbin", compiler="nvcc")) > 1000
    static = dict(base, batch=1, seq_q=1, seq_k=512, mask_shape=(1, 1, 1, 512))
    assert NO_CSE_ATTR not in ATTENTION_DECODE(static, ATTENTION_DECODE.default_knobs(static)).attrs


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_fp32_cache_view_decode_kernel_compiles_with_nvcc():
    """An fp32 cache (an fp32 build's in-place decode): the decode template's zeros for a slot without keys are
    written element by element; as one float32x8 vector TVM emitted make_ulonglong4 of 8 floats, which nvcc rejects
    (the CUDA-graph decode test's build failed so on the H200, bench/results/gpu_tests_run26.txt)."""
    from tvmfuse.build.compile import TIR_PIPELINE

    one = dict(CACHE_STEP, heads=32, kv_heads=32, head_dim=128, dtype="float32", seq_q=1,
               mask_shape=("batch", 1, 1, "past + seq"))
    fn = ATTENTION_DECODE(one, ATTENTION_DECODE.default_knobs(one))
    src = tvm.compile(tvm.IRModule({"main": fn}), target=H100, tir_pipeline=TIR_PIPELINE).mod.imports[0] \
        .inspect_source("cuda")
    assert "make_ulonglong4(" not in src and src.count("= *(ulonglong4*)(k_ptr + ") >= 1
    with H100:
        assert len(tvm.support.nvcc.compile_cuda(src, "fatbin", compiler="nvcc")) > 1000


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
def test_gpu_cache_view_kernels_match_numpy():
    """On a GPU: the step template (one kernel, its decode branch with several knob sets and its prefill branch
    with every knob set) and the decode template over the cache's view, at every (batch, past, seq) of
    CACHE_STEPS, against numpy; a fully masked row is 0."""
    from tvmfuse.kernels import ATTENTION_STEP

    from tvmfuse.kernels.attention.prefill_knobs import knob_space
    from tvmfuse.kernels.attention.step import join_knobs

    dev, rng = tvm.cuda(0), np.random.default_rng(13)
    cases = [_cache_case(rng, *c) for c in CACHE_STEPS]
    decodes = [{"split": 1, "warps": 8, "unroll": 4}, {"split": 16, "warps": 4, "unroll": 2},
               {"split": 64, "warps": 2, "unroll": 1}]
    knob_sets = [ATTENTION_STEP.default_knobs(CACHE_STEP)] + [
        join_knobs(decodes[i % len(decodes)], p) for i, p in enumerate(knob_space(CACHE_STEP))]
    for knobs in knob_sets:
        lib = tvm.compile(tvm.IRModule({"main": ATTENTION_STEP(CACHE_STEP, knobs)}), target=H100)
        for (batch, past, seq), (args, want) in zip(CACHE_STEPS, cases):
            got = _run_step(lib, args, want, dev)
            assert np.abs(got - want).max() < 2e-3, (knobs, batch, past, seq)
            if past and batch > 1:
                assert np.abs(got[1, -1]).max() == 0, (knobs, batch, past, seq)
    s = dict(CACHE_STEP, seq_q=1, mask_shape=("batch", 1, 1, "past + seq"))
    lib = tvm.compile(tvm.IRModule({"main": ATTENTION_DECODE(s)}), target=H100)
    for (batch, past, seq), (args, want) in zip(CACHE_STEPS, cases):
        if seq == 1:
            assert np.abs(_run_step(lib, args, want, dev) - want).max() < 2e-3, (batch, past)
