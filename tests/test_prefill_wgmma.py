"""tvmfuse.kernels.attention.prefill_wgmma and prefill_wgmma_kernel: the Hopper prefill attention template (TMA,
wgmma, P in registers), its checks and knob space, its CUDA source, and the sites it takes in exported models."""

from __future__ import annotations

import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes  # noqa: F401  (numpy's "bfloat16" dtype)
import numpy as np
import pytest
import tvm
from checks import ptxas_report
from tvm import relax

from tvmfuse.kernels import ATTENTION_PREFILL, ATTENTION_PREFILL_WGMMA, template_sites
from tvmfuse.kernels.attention.common import normalize
from tvmfuse.kernels.attention.prefill_wgmma import MAX_SMEM, default_knobs, knob_space, smem_bytes
from tvmfuse.kernels.attention.prefill_wgmma_kernel import tma_map
from tvmfuse.kernels.hopper.gemm_bench import hopper_target
from tvmfuse.kernels.substitution import _causal_constant

BASE = dict(batch=1, heads=4, kv_heads=2, seq_q=256, seq_k=256, head_dim=128, dtype="float16", causal=True,
            arch="sm_90a")


def _ref(q, k, v, causal):
    """softmax(Q K^T / sqrt(d)) V on [B,H,S,D] arrays in fp32 (K and V heads repeated for GQA)."""
    kk, vv = (np.repeat(x, q.shape[1] // x.shape[1], 1).astype("f4") for x in (k, v))
    s = q.astype("f4") @ kk.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ vv


_SOURCES: dict[str, str] = {}


def _source(s: dict, knobs: dict | None = None) -> str:
    """The kernel's CUDA source, compiled once per shapes and knobs in this process (the tests ask for many twice)."""
    key = json.dumps([s, knobs], sort_keys=True, default=str)
    if key not in _SOURCES:
        fn = ATTENTION_PREFILL_WGMMA(s, knobs)
        ex = tvm.compile(tvm.IRModule({"main": fn}), target=hopper_target(), tir_pipeline="tirx")
        _SOURCES[key] = ex.mod.imports[0].inspect_source()
    return _SOURCES[key]


def _nvcc(src: str) -> bytes:
    with hopper_target():
        return tvm.support.nvcc.compile_cuda(src, "fatbin", compiler="nvcc")


@pytest.mark.parametrize("change,reason", [
    (dict(arch="sm_90"), "needs sm_90a"),
    (dict(arch=None), "needs sm_90a"),
    (dict(dtype="float32"), "fp16/bf16"),
    (dict(q_dtype="float32"), "fp16/bf16 Q, K and V of one dtype"),
    (dict(head_dim=96), "head_dim 96 is not 64 or 128"),
    (dict(causal=False, mask="additive", mask_shape=(1, 1, 256, 256)), "an additive mask"),
    (dict(seq_q="seq", seq_k="seq"), "symbolic sizes"),
    (dict(kv_heads=3), "must divide"),
    (dict(seq_k=300), "causal needs seq_q == seq_k"),
    (dict(seq_q=32, seq_k=32), "below one 64-row tile"),
])
def test_check_says_why_it_refuses(change, reason):
    """Every shape it refuses gets a reason (the mma.sync template, tried next, takes them); fp16 and bf16 with
    GQA, head dims 64 and 128 and each stored layout pass."""
    s = {k: v for k, v in dict(BASE, **change).items() if v is not None}
    assert reason in (ATTENTION_PREFILL_WGMMA.check(s) or ""), ATTENTION_PREFILL_WGMMA.check(s)
    for ok in (BASE, dict(BASE, dtype="bfloat16", head_dim=64, causal=False, seq_k=1000),
               dict(BASE, q_layout="BSHD", k_layout="SBHD", v_layout="BSHD", out_layout="BSHD")):
        assert ATTENTION_PREFILL_WGMMA.check(ok) is None


def test_knob_space_fits_shared_memory_and_the_default_is_the_measured_best():
    """Every knob set fits MAX_SMEM and the register rule; head dim 128 defaults to the measured picks
    (attention_run10/11: 176 keys, overlapped, ping-pong, query tiles first without causality; 128 keys overlapped
    with it), head dim 64 to 128 keys in turn; three stages of 176 keys at head dim 128 do not fit."""
    base = {"consumers": 2, "stages": 2, "setmaxnreg": 1, "batched": 0, "cluster": 1}
    causal = dict(base, block_n=128, overlap=1, pingpong=0, order=0)
    for shape, want in [(BASE, causal),
                        (dict(BASE, causal=False), dict(base, block_n=176, overlap=1, pingpong=1, order=1)),
                        (dict(BASE, causal=False, seq_q=384, seq_k=384), dict(base, block_n=176, overlap=1,
                                                                               pingpong=1, order=1)),
                        (dict(BASE, head_dim=64), dict(causal, overlap=0)),
                        (dict(BASE, head_dim=64, causal=False), dict(causal, overlap=0, order=1))]:
        s = normalize(shape)
        space = knob_space(s)
        assert space and all(smem_bytes(s, k) <= MAX_SMEM for k in space)
        assert default_knobs(s) == want and want in space
    s = normalize(BASE)
    assert knob_space(s)[0]["overlap"] == 1  # --trials measures the overlapped sets first, after the default
    assert smem_bytes(s, default_knobs(s)) == 160 * 1024
    assert dict(causal, block_n=176, stages=3) not in knob_space(s)


def test_tma_maps_address_each_layout_in_place():
    """4-D maps, innermost first, byte strides; boxes of 64 head-dim elements x the tile's rows along the sequence
    axis of each layout; coordinates in the same order."""
    args, at = tma_map("BHSD", 2, 8, 512, 128, 128)
    assert args[:4] == [128, 512, 8, 2] and args[4:7] == [256, 256 * 512, 256 * 512 * 8]
    assert args[7:11] == [64, 128, 1, 1]
    assert at("b", "h", "s", 64) == [64, "s", "h", "b"]
    args, at = tma_map("BSHD", 2, 8, 512, 128, 64)
    assert args[:4] == [128, 8, 512, 2] and args[7:11] == [64, 1, 64, 1] and at("b", "h", "s", 0) == [0, "h", "s", "b"]
    args, at = tma_map("SBHD", 2, 8, 512, 64, 128)
    assert args[:4] == [64, 8, 2, 512] and args[7:11] == [64, 1, 1, 128] and at("b", "h", "s", 0) == [0, "h", "b", "s"]
    assert args[-4:] == [0, 3, 3, 0]  # 128-byte swizzle: the layout the wgmma descriptors name


KERNELS = [  # shapes, knobs, (TMA panels per tile, masked softmax emitted)
    (BASE, None, 2, True),
    (dict(BASE, causal=False),  # static, tiles divide: no score is tested; overlapped
     {"consumers": 2, "block_n": 128, "stages": 2, "setmaxnreg": 1, "overlap": 1, "pingpong": 0, "cluster": 1}, 2,
     False),
    (dict(BASE, causal=False, seq_k=200, head_dim=64, dtype="bfloat16"),  # ragged L, one consumer, in turn
     {"consumers": 1, "block_n": 64, "stages": 3, "setmaxnreg": 0, "overlap": 0, "pingpong": 0}, 1, True),
    (dict(BASE, q_layout="BSHD", k_layout="BSHD", v_layout="BSHD", out_layout="BSHD", heads=8, kv_heads=8),
     {"consumers": 2, "block_n": 176, "stages": 2, "setmaxnreg": 1, "overlap": 1, "pingpong": 1}, 2, True),
    (dict(BASE, causal=False, seq_k=200),  # ragged L; batched (P V of j - 1 and S of j waited for together), ping-pong
     {"consumers": 2, "block_n": 64, "stages": 3, "setmaxnreg": 1, "overlap": 0, "batched": 1, "pingpong": 1,
      "cluster": 1}, 2, True),
    (dict(BASE, causal=False),  # clusters of two query tiles: each CTA multicasts one panel of K and V to both
     {"consumers": 2, "block_n": 128, "stages": 2, "setmaxnreg": 1, "overlap": 1, "pingpong": 1, "cluster": 2}, 2, False),
]


@pytest.mark.parametrize("s,knobs,panels,masked", KERNELS,
                         ids=["causal", "plain", "ragged_bf16", "bshd_176", "batched_pingpong", "cluster"])
def test_kernel_source_is_tma_loads_and_two_wgmma_forms(s, knobs, panels, masked):
    """Q, K and V arrive by 4-D TMA (one copy per 64-wide panel each); S = Q K^T is the shared-memory form of wgmma
    whose first k-step overwrites S; P V takes P from registers (four 32-bit A registers) and V transposed
    (MN-major); the masked softmax exists only where a tile can cross the diagonal or run past L; with two
    consumers the loader gives its registers up; overlapped, tile j's S is waited for while tile j - 1's P V may still
    run (wait_group 1); the descriptors are prefetched and the epilogue divides once a row. nvcc compiles it for
    sm_90a."""
    s = normalize(s)
    knobs = knobs or default_knobs(s)
    src = _source(s, knobs)
    ab = "bf16" if s["dtype"] == "bfloat16" else "f16"
    bn, d = knobs["block_n"], s["head_dim"]
    cluster = knobs.get("cluster", 1)
    assert src.count("cp_async_bulk_tensor_g2s_cluster_async_bulk_tensor_4d_shared__cluster_global_mbarrier__complete"
                     "_tx__bytes(tvm_builtin_cuda_cvta") == (1 if cluster == 2 else 3) * panels  # Q (, K, V)
    ss = f"wgmma_{ab}_ss_mma_async_sync_aligned_m64n{bn}k16_f32_{ab}_{ab}_1_1_0_0("
    rs = f"wgmma_{ab}_rs_mma_async_sync_aligned_m64n{d}k16_f32_{ab}_{ab}_1_1_1("
    # overlapped or batched: S issued before the loop and in it, P V in it and after it
    copies = 2 if knobs["overlap"] or knobs.get("batched") else 1
    assert src.count(ss) == copies * d // 16 + 1 and src.count(rs) == copies * bn // 16 + 1  # + the helper
    assert src.count(", (bool)0);") == copies  # the first of the d // 16 k-steps of S
    assert src.count("complete_tx__bytes_multicast__cluster(tvm_builtin_cuda_cvta") == (2 if cluster == 2 else 0)
    # the helper, then each release: K and V apart (K once its S is done), in the loop and (pipelined) around it
    assert src.count("tvmfuse_arrive_cluster(") == (1 + 2 * copies if cluster == 2 else 0)
    assert (src.count("barrier.cluster.wait") > 0) == (cluster == 2)
    assert src.count("tvm_builtin_ptx_wgmma_wait_group_wait_group_sync_aligned_1();") == (1 if knobs["overlap"] else 0)
    assert src.count("tvmfuse_softmax_anchor(") == (2 if knobs["overlap"] else 0)  # the helper and its one call
    assert ("anchor_ptr[1]" in src) == bool(knobs["overlap"])  # its 4 bytes of shared memory: overlapped loops only
    # ping-pong: a turn taken before each of the 3 issue points, and consumer 1 lets consumer 0 go first
    # (+ the helper), and each consumer's meeting before its output's TMA store (tma_store: by default, BHSD and BSHD
    # outputs)
    tma_store = s["out_layout"] in ("BHSD", "BSHD")
    meet = (2 - knobs["pingpong"]) if tma_store else 0  # (+ the helper where ping-pong has none)
    assert src.count("tvmfuse_bar_sync(") == (4 if knobs["pingpong"] else 0) + meet
    assert ("tvmfuse_bar_arrive(1, 256)" in src) == bool(knobs["pingpong"])
    pack = "tvmfuse_pack_bf162(" if ab == "bf16" else "tvmfuse_pack_half2("
    assert src.count(pack) >= bn // 4
    assert (src.count("-0x1.93e5939a08ceap+99f") > 2) == masked  # a score the row must not see -> NEG (2: m's start)
    assert ("setmaxnreg_inc_sync_aligned_u32_232" in src) == bool(knobs["setmaxnreg"])
    assert f"__launch_bounds__({128 * (1 + knobs['consumers'])})" in src
    assert src.count("tvm_builtin_ptx_prefetch_tensormap(") == 1 + 3  # the helper; Q's, K's and V's descriptors
    # the epilogue divides once a row (each thread's two) and multiplies: no IEEE division per output element
    assert "/ st_ptr[" not in src and src.count("/ tvm_builtin_cuda_warp_reduce_sum_4(st_ptr[") == 2
    if shutil.which("nvcc"):
        assert len(_nvcc(src)) > 1000


def test_clusters_only_pair_full_rows_of_non_causal_tiles():
    """cluster 2 is offered only without causality (the paired tiles read the same K/V tiles), at head dim 128 (a
    panel a CTA) and for an even number of query tiles; the kernel builder refuses it elsewhere."""
    plain = normalize(dict(BASE, causal=False))
    assert {k["cluster"] for k in knob_space(plain)} == {1, 2}
    for s in (BASE, dict(BASE, causal=False, head_dim=64), dict(BASE, causal=False, seq_q=384)):
        assert {k["cluster"] for k in knob_space(normalize(s))} == {1}
    with pytest.raises(ValueError, match="cluster 2 needs non-causal"):
        ATTENTION_PREFILL_WGMMA(normalize(BASE), dict(default_knobs(normalize(BASE)), cluster=2))


def _loop_waits_and_exponentials(sass: str) -> list[str]:
    """The kernel's wgmma waits and exponentials in program order: 'W1'/'W0' (WARPGROUP.DEPBAR.LE gsb0, 1 or 0), 'e'
    (MUFU.EX2)."""
    from bench.attention_sass import parse_sass  # pylint: disable=import-outside-toplevel
    (ins,) = parse_sass(sass).values()
    return ["W" + args[-1] if op == "WARPGROUP.DEPBAR.LE" else "e" for _, _, op, args in ins
            if op in ("WARPGROUP.DEPBAR.LE", "MUFU.EX2")]


@pytest.mark.parametrize("block_n", [128, 64])
def test_overlapped_loop_issues_every_exponential_before_waiting_for_pv(block_n):
    """In the SASS of the overlapped non-causal loop (no mask branch in it), the softmax's block_n / 2 exponentials
    and the 2 of the rescale factors all lie between the wait for S (depbar 1) and the wait for P V (depbar 0):
    without the anchor store ptxas put the second wait before them, so P V overlapped nothing."""
    from bench.sass_mix import sass_of, tool  # pylint: disable=import-outside-toplevel
    try:
        tool("nvcc"), tool("cuobjdump"), tool("nvdisasm")
    except SystemExit as e:
        pytest.skip(str(e))
    s = normalize(dict(BASE, causal=False, heads=32, kv_heads=32, seq_q=2048, seq_k=2048))
    knobs = {"consumers": 2, "block_n": block_n, "stages": 2, "setmaxnreg": 1, "overlap": 1, "batched": 0,
             "pingpong": 0, "cluster": 1}
    seq = "".join(_loop_waits_and_exponentials(sass_of(_source(s, knobs))))
    assert seq.count("W1") == 1, seq
    between = seq.split("W1")[1].split("W0")[0]
    assert between == "e" * (block_n // 2 + 2), seq


def test_causal_constant_is_recognised_only_when_exactly_causal():
    """A folded [1, 1, S, S] mask with 0 on and below the diagonal and -inf (or finfo.min) above is causal; a 0
    above, a -inf below, a batch axis, a non-square mask or other sizes are not."""
    n = 8
    causal = np.triu(np.full((n, n), -np.inf, "float32"), 1)[None, None]

    def call(array):
        return relax.Call(relax.ExternFunc("f"), [relax.ExternFunc("g"), relax.Tuple([relax.const(array)])])

    shapes = {"seq_q": n, "seq_k": n}
    assert _causal_constant(call(causal), 0, shapes)
    assert _causal_constant(call(np.maximum(causal, np.finfo("float32").min)), 0, shapes)
    assert _causal_constant(call(np.maximum(causal, -65504).astype("float16")), 0, shapes)
    for bad in (np.where(np.isinf(causal), -1.0, 0.0).astype("float32"),  # -1 above: not masked out
                np.where(np.eye(n, dtype=bool), -np.inf, causal).astype("float32"),  # the diagonal masked
                np.concatenate([causal, causal]),  # a batch axis
                causal[..., :-1]):
        assert not _causal_constant(call(bad), 0, shapes)
    assert not _causal_constant(call(causal), 0, {"seq_q": n, "seq_k": n + 1})


@pytest.fixture(scope="module")
def decoder_exports(tmp_path_factory):
    """bench/hf_models.py's static prefill exports (seq 128) of a tiny GPT-2 (2 heads of 64) and a tiny GQA Llama
    (2 heads of 64 over 1 KV head)."""
    pytest.importorskip("transformers")
    import torch
    import transformers as tf

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import hf_models as hm  # pylint: disable=import-outside-toplevel

    folder, paths = tmp_path_factory.mktemp("wgmma_att"), {}
    torch.manual_seed(0)
    for name, model in (
            ("gpt2", tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=128, n_layer=1, n_head=2, n_positions=128,
                                                      vocab_size=128))),
            ("llama", tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                                         num_attention_heads=2, num_key_value_heads=1,
                                                         vocab_size=128, max_position_embeddings=128)))):
        paths[name] = str(folder / f"{name}.onnx")
        hm.export(hm.wrap(model.eval(), "prefill_512"), hm.inputs(name, model, {"batch": 1, "seq": 128, "kv_len": 0}),
                  paths[name])
    return paths


def _fused(path: str, target):
    from tvmfuse.decide.decision import decide
    from tvmfuse.frontend.importer import import_model, load_onnx
    from tvmfuse.fuse.fusion import lower
    from tvmfuse.prepare import prepare_module

    bound = prepare_module(import_model(load_onnx(path), {}), "fp16")
    return lower(bound, plan=decide(bound, target))


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_static_decoders_attention_is_causal_and_takes_the_wgmma_template_on_sm_90a(decoder_exports, model):
    """The exports' folded causal mask becomes causal attention without a mask parameter; on an sm_90a target the
    wgmma template takes the kernel, on an sm_90 one (and with the kind's name alone) the mma.sync template."""
    from tvmfuse.targets import resolve_target

    fused = _fused(decoder_exports[model], resolve_target("cuda"))
    sites = template_sites(fused.mod, fused.kernel_patterns, target=hopper_target())
    assert [(site[2].name, site[3]["causal"], site[3]["mask"]) for site in sites] == [
        ("attention_prefill_wgmma", True, "none")]
    assert len(sites[0][4]) == 3  # q, k, v: the mask is no argument any more
    if model == "llama":
        assert (sites[0][3]["heads"], sites[0][3]["kv_heads"]) == (2, 1)
    sm90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    for target in (sm90, "cuda"):
        (site,) = template_sites(fused.mod, fused.kernel_patterns, target=target)
        assert site[2] is ATTENTION_PREFILL and site[3]["causal"]


def test_cli_export_runs_the_wgmma_attention_kernel(decoder_exports, tmp_path, capsys):
    """`tune.py --target cuda --trials 0` on the GPT-2 export: the manifest names the attention kernel's schedule
    as the TIRx kernel and the log says which template took it (verification needs a GPU: skipped here, run on
    it by the GPU test below)."""
    import json

    from tvmfuse.cli.tune import main

    if tvm.cuda(0).exist:
        pytest.skip("this machine has a GPU (the job would verify and time on it: the GPU test below)")
    rc = main(["--target", "cuda", "--trials", "0", "--dtype", "fp16", "--out", str(tmp_path / "o"), "--logs",
               str(tmp_path / "l"), decoder_exports["gpt2"]])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "template attention_prefill_wgmma, default knobs" in out
    (manifest,) = list((tmp_path / "o").glob("*/manifest.json"))
    kinds = {k["pattern"]: k["schedule"] for k in json.loads(manifest.read_text())["kernels"]}
    assert kinds["tvmfuse.attention"] == "wgmma_attention (TIRx kernel)"


GPU_SHAPES = [
    dict(BASE),
    dict(BASE, causal=False, seq_k=200),  # ragged L: TMA's zero rows weigh nothing
    dict(BASE, head_dim=64, heads=8, kv_heads=8, causal=False, seq_q=192, seq_k=320),  # ragged query tiles
    dict(BASE, q_layout="BSHD", k_layout="BSHD", v_layout="BSHD", out_layout="BSHD", seq_q=384, seq_k=384),
    # 160 query tiles: persistent CTAs (one an SM, 132) take two work items on some SMs
    dict(BASE, batch=2, heads=40, kv_heads=8, seq_q=256, seq_k=256, causal=False),
    dict(BASE, causal=False, seq_q=128, seq_k=100),  # one K/V tile, the tail: its P V over 112 keys
]


def _each_knob_value(s: dict) -> list[dict]:
    """The default knob set, and for every other value of every knob the set of the space closest to the default
    with it: each value runs on the GPU without building all of the space (up to 40 sets)."""
    space, base = knob_space(s), default_knobs(s)
    chosen = [base]
    for key in base:
        for value in sorted({k[key] for k in space} - {base[key]}):
            best = min((k for k in space if k[key] == value), key=lambda k: sum(k[x] != base[x] for x in base))
            chosen += [best] if best not in chosen else []
    # and the default tile ping-ponged, overlapped or batched, with clusters where they pair: knobs that interact
    chosen += [k for k in space if k["pingpong"] and k not in chosen and
               all(k[x] == base[x] for x in ("consumers", "block_n", "stages", "setmaxnreg"))]
    # persistent CTAs (not in the space: they lost): the default and the ping-pong sets, without clusters
    for k in chosen[:1] + [k for k in chosen if k["pingpong"]]:
        chosen += [dict(k, cluster=1, persistent=1)] if dict(k, cluster=1, persistent=1) not in chosen else []
    # the default with the other output store: half2 stores from registers where the TMA store is the default (BHSD
    # and BSHD outputs), the TMA store where it is not
    chosen.append(dict(chosen[0], tma_store=0 if s["out_layout"] in ("BHSD", "BSHD") else 1))
    # with causality, query tiles first (outside the space until measured): the default with it
    if s["causal"]:
        chosen.append(dict(chosen[0], order=1))
    # chained work items (not in the space until measured): the default's tile, persistent, overlapped, 128 keys
    chained = dict(chosen[0], cluster=1, persistent=1, chain=1, overlap=1, batched=0, pingpong=0,
                   block_n=min(chosen[0]["block_n"], 128))
    try:
        ATTENTION_PREFILL_WGMMA(s, chained)
        chosen.append(chained)
    except ValueError:  # two Q buffers do not fit beside its stages
        pass
    return chosen


def _stored(x, layout):
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3) if layout == "BSHD" else x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", range(len(GPU_SHAPES)),
                         ids=["causal", "ragged_k", "d64_ragged_q", "bshd", "many_tiles", "short_k"])
def test_every_knob_set_matches_numpy_on_the_gpu(shape, dtype):
    """The default knob set and every other value of each knob (`_each_knob_value`) against fp32 numpy: causal and
    not, GQA, ragged sizes, BSHD in place."""
    s = normalize(dict(GPU_SHAPES[shape], dtype=dtype))
    rng, dev = np.random.default_rng(shape), tvm.cuda(0)
    B, H, HKV, SQ, L, D = (s[k] for k in ("batch", "heads", "kv_heads", "seq_q", "seq_k", "head_dim"))
    q, k, v = (rng.standard_normal(sh).astype(dtype) for sh in ((B, H, SQ, D), (B, HKV, L, D), (B, HKV, L, D)))
    want = _ref(q, k, v, s["causal"])
    args = [tvm.runtime.tensor(_stored(x, s[f"{r}_layout"]), dev) for r, x in (("q", q), ("k", k), ("v", v))]
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    sets = _each_knob_value(s)
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:  # nvcc in parallel: each set's build is a few seconds
        libs = list(pool.map(lambda kn: tvm.compile(tvm.IRModule({"main": ATTENTION_PREFILL_WGMMA(s, kn)}),
                                                    target=hopper_target(), tir_pipeline="tirx"), sets))
    for knobs, lib in zip(sets, libs):
        print("knobs", knobs, flush=True)  # with -s: the set a hung kernel (a lost mbarrier phase) ran
        out = tvm.runtime.tensor(np.full(_stored(want, s["out_layout"]).shape, np.nan, dtype), dev)
        lib["main"](*args, out)
        got = out.numpy().astype("f4")
        got = got.transpose(0, 2, 1, 3) if s["out_layout"] == "BSHD" else got
        assert np.abs(got - want).max() < tol, knobs


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_exported_decoders_verify_against_onnxruntime_on_the_gpu(decoder_exports, model, tmp_path):
    """The product path on the H200: the export with the wgmma attention kernel verifies against onnxruntime."""
    from tvmfuse.jobs import Job
    from tvmfuse.pipeline import run_job
    from tvmfuse.targets import resolve_target

    said = []
    result = run_job(Job(model, decoder_exports[model], trials=0, dtype="fp16"), resolve_target("cuda"),
                     str(tmp_path / "out"), str(tmp_path / "logs"), say=said.append, schedules=None)
    assert result.ok and result.verification.startswith("ok"), (result.error, result.verification, said[-20:])
    assert any("template attention_prefill_wgmma" in line for line in said), said


def test_the_benchmark_cases_are_the_issues_shapes_and_the_template_takes_each():
    """bench/attention.py's wgmma cases: causal and not at 2048 and 8192 tokens, 32 heads of 128, a GQA case with 8
    KV heads, fp16 and bf16; the template's check passes every one on sm_90a."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.attention import WGMMA_CASES  # pylint: disable=import-outside-toplevel

    seen = {(s["seq_q"], s["causal"], s["kv_heads"], s["dtype"]) for _, _, s in WGMMA_CASES}
    for dtype in ("float16", "bfloat16"):
        assert {(n, c, 32, dtype) for n in (2048, 8192) for c in (True, False)} | {(8192, True, 8, dtype)} <= seen
    for _, kind, s in WGMMA_CASES:
        assert kind == "prefill_wgmma" and s["head_dim"] == 128 and s["heads"] == 32
        assert ATTENTION_PREFILL_WGMMA.check(dict(s, arch="sm_90a")) is None


def test_the_keys_sweep_fits_a_line_whose_intercept_is_the_per_cta_cost():
    """bench/attention.py --only keys_wgmma: 2048 queries against 128 ... 2048 keys (the template takes each, and the
    models' shapes, --only model_wgmma); the fit recovers intercept and slope from exact points and skips a case
    without a time."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.attention import KEYS_SWEEP, MODEL_CASES, fixed_cost_fit  # pylint: disable=import-outside-toplevel

    assert [s["seq_k"] for _, _, s in KEYS_SWEEP] == [128, 256, 512, 1024, 2048]
    assert all(ATTENTION_PREFILL_WGMMA.check(dict(s, arch="sm_90a")) is None for _, _, s in KEYS_SWEEP + MODEL_CASES)
    assert {(s["heads"], s["head_dim"], s["seq_q"]) for _, _, s in MODEL_CASES} == {
        (12, 64, 512), (12, 64, 2048), (32, 128, 512), (32, 128, 2048)}  # GPT-2's and Llama-2-7B's, causal
    cases = {name: {"tvmfuse_us": 20.0 + 0.05 * s["seq_k"],
                    "torch_backends_us": {"CUDNN_ATTENTION": 5.0 + 0.05 * s["seq_k"]}} for name, _, s in KEYS_SWEEP}
    cases[KEYS_SWEEP[0][0]]["torch_backends_us"]["CUDNN_ATTENTION"] = "failed: no kernel"
    fit = fixed_cost_fit({"cases": cases})
    assert fit["tvmfuse"]["intercept_us"] == pytest.approx(20.0)
    assert fit["tvmfuse"]["us_per_128_keys"] == pytest.approx(6.4)
    assert fit["cudnn"]["intercept_us"] == pytest.approx(5.0) and len(fit["cudnn"]["points"]) == 4


def test_a_dynamic_dynamo_export_takes_it_in_its_batch_and_seq_bucket(tmp_path, monkeypatch, capsys):
    """A tiny GPT-2 exported by the dynamo exporter with input_ids alone and dynamic batch and sequence (2 heads of
    64): with --buckets batch=1 --buckets seq=128 the bucket function's causal mask is a folded constant and the wgmma
    template takes its attention; the symbolic main keeps the step template."""
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript (dev extra)")
    hf_export = pytest.importorskip("hf_export")
    from tvmfuse.cli.tune import main

    if tvm.cuda(0).exist:
        pytest.skip("this machine has a GPU (the job would verify and time on it)")
    monkeypatch.setattr(hf_export, "HIDDEN", 128)
    monkeypatch.setattr(hf_export, "HEADS", 2)
    path = hf_export.export("gpt2", "dynamo", str(tmp_path), ids_only=True)
    rc = main(["--target", "cuda", "--trials", "0", "--dtype", "fp16", "--buckets", "batch=1", "--buckets", "seq=128",
               "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "l"), path])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = [ln for ln in out.splitlines() if ": template attention" in ln]
    assert [ln.split("] ", 1)[1].startswith("main_batch1_seq128: ") for ln in lines if "prefill_wgmma" in ln] == [True]
    assert any("template attention_step" in ln and "main_batch1_seq128" not in ln for ln in lines), lines
    (manifest,) = (tmp_path / "o").glob("*/manifest.json")  # the kernel stage's choice is in the manifest too
    bucket = [k for k in json.loads(manifest.read_text())["kernels"] if k["name"].endswith("_batch1_seq128")]
    assert [k["kernel"].split(",")[0] for k in bucket if k["pattern"] == "tvmfuse.attention"] == [
        "template attention_prefill_wgmma"], bucket


def test_the_benchmark_knob_filter_reads_name_int_pairs():
    """bench/attention.py --knobs: NAME=INT items; anything else is one error line (SystemExit)."""
    from bench.attention import knob_filter  # pylint: disable=import-outside-toplevel
    assert knob_filter("consumers=2, setmaxnreg=1") == {"consumers": 2, "setmaxnreg": 1}
    assert knob_filter("") == {}
    for bad in ("consumers", "consumers=two", "=2"):
        with pytest.raises(SystemExit, match="error: --knobs"):
            knob_filter(bad)


def test_the_benchmark_supervisor_times_each_child_from_its_own_start_and_lets_builds_run():
    """bench/attention.py's supervisor: a child that follows a killed one is not killed for the old report's age,
    and one building its knob sets (CPU only) gets BUILD_S, not the hung-kernel HANG_S."""
    from bench.attention import BUILD_S, HANG_S, child_is_hung  # pylint: disable=import-outside-toplevel
    assert not child_is_hung(report_mtime=0.0, child_started=100.0, building=False, now=100.0 + HANG_S - 1)
    assert child_is_hung(report_mtime=0.0, child_started=100.0, building=False, now=100.0 + HANG_S + 1)
    assert not child_is_hung(report_mtime=100.0, child_started=0.0, building=True, now=100.0 + HANG_S + 60)
    assert child_is_hung(report_mtime=100.0, child_started=0.0, building=True, now=100.0 + BUILD_S + 1)


def test_the_benchmark_measures_each_set_again_with_each_group_of_outside_knobs_it_takes():
    """bench/attention.py --with "persistent=1;persistent=1,chain=1": each set of the space, then each again with each
    group, leaving out what the kernel refuses (here: chain with ping-pong, persistent with clusters)."""
    from bench.attention import with_outside_knobs  # pylint: disable=import-outside-toplevel
    s = normalize(dict(BASE, heads=32, kv_heads=32, seq_q=2048, seq_k=2048, causal=False))
    base = dict(default_knobs(s), block_n=128, cluster=1)
    space = [dict(base, pingpong=0), dict(base, pingpong=1), dict(base, pingpong=0, cluster=2)]
    sets, funcs = with_outside_knobs(space, [{"persistent": 1}, {"persistent": 1, "chain": 1}],
                                     lambda kn: ATTENTION_PREFILL_WGMMA(s, kn))
    assert sets == space + [dict(space[0], persistent=1), dict(space[1], persistent=1),
                            dict(space[0], persistent=1, chain=1)]
    assert len(funcs) == len(sets)
    # tail=0 changes only the sets with a ragged last tile (176 keys at 2048; 128 divides it): the others not twice
    tiles = [dict(base, pingpong=1, block_n=176), dict(base, pingpong=1)]
    sets, funcs = with_outside_knobs(tiles, [{"tail": 0}], lambda kn: ATTENTION_PREFILL_WGMMA(s, kn))
    assert sets == tiles + [dict(tiles[0], tail=0)] and len(funcs) == 3


def test_the_diagnostic_ablations_leave_out_their_part_and_are_never_tuned():
    """ablate "softmax" emits no exponential, "pv" no register-A (P V) wgmma; neither is a knob set of the space, and
    an unknown part is refused."""
    s = normalize(dict(BASE, causal=False))
    base = default_knobs(s)
    assert all("ablate" not in k for k in knob_space(s))
    plain, no_softmax, no_pv = (_source(s, dict(base, ablate=a)) for a in ("", "softmax", "pv"))
    assert plain.count("tvmfuse_ex2(") > 0 and no_softmax.count("tvmfuse_ex2(") == 0
    assert "_rs_mma_async" in plain and "_rs_mma_async" not in no_pv
    with pytest.raises(ValueError, match="ablate 'exp'"):
        ATTENTION_PREFILL_WGMMA(s, dict(base, ablate="exp"))


def test_persistent_ctas_loop_over_work_items_and_wait_for_q_to_be_free():
    """persistent: one CTA an SM (132) walks work items bid, bid + 132, ...; the loader waits on q_empty (one arrival
    per consumer warp, after its last S of an item) before the next Q; the consumers wait on q_full's phase of each
    item; no clusters with it; not in the knob space until measured."""
    s = normalize(dict(BASE, batch=2, heads=40, kv_heads=8, causal=False))  # 160 query tiles
    knobs = dict(default_knobs(s), cluster=1, persistent=1)
    src = _source(s, knobs)
    assert "for (int ti = 0; ti < ((291 - ((int)blockIdx.x)) / 132); ++ti)" in src  # (160 - bid + 131) // 132
    assert "q_empty_ptr[0]))), (uint)8);" in src  # 4 warps x 2 consumers
    assert src.count("tvm_builtin_cuda_mbarrier_wait((&(q_empty_ptr[0])), ") == 1  # the loader, before Q of item 2+
    assert src.count("mbarrier_arrive_nocount_arrive_shared_b64(tvm_builtin_cuda_cvta_generic_to_shared((&(q_empty") == 1
    plain = _source(s, dict(knobs, persistent=0))  # one work item a CTA: nothing waits on or arrives at q_empty
    assert "mbarrier_wait((&(q_empty" not in plain and "(&(q_empty_ptr[0]))));" not in plain
    assert all(not k.get("persistent") for k in knob_space(s))
    with pytest.raises(ValueError, match="persistent CTAs take no clusters"):
        ATTENTION_PREFILL_WGMMA(s, dict(knobs, cluster=2))
    if shutil.which("nvcc"):
        assert len(_nvcc(src)) > 1000


def test_order_1_gives_consecutive_ctas_consecutive_query_tiles_of_one_head():
    """order 1: CTA t takes query tile t % QT of head t // QT (rows (t & 7) * 128 with 8 tiles of 128), with causality
    QT - 1 - t % QT (each head's longest rows first), so the CTAs running at once share the K and V of few heads; 0
    keeps heads first; the space has both without causality (the default 1, attention_run11: ahead in 28 of 32
    pairs), with causality 0 alone (1 not measured yet)."""
    first_row = "((int)blockIdx.x) & 7) * 128)"
    for causal in (False, True):
        s = normalize(dict(BASE, seq_q=1024, seq_k=1024, heads=8, kv_heads=8, causal=causal))  # 8 tiles, 8 heads
        knobs = dict(default_knobs(s), cluster=1)
        assert first_row in _source(s, dict(knobs, order=1)) and first_row not in _source(s, dict(knobs, order=0))
        assert {k["order"] for k in knob_space(s)} == ({0} if causal else {0, 1})
        assert default_knobs(s)["order"] == (0 if causal else 1)
    with pytest.raises(ValueError, match="order 2: 0"):
        ATTENTION_PREFILL_WGMMA(s, dict(knobs, order=2))


@pytest.mark.parametrize("seq_k,block_n,last", [(2048, 176, 112), (100, 128, 112), (2048, 128, 0)])
def test_the_tail_tile_runs_its_softmax_and_p_v_over_the_keys_it_has(seq_k, block_n, last):
    """Overlapped and not causal, the last K/V tile of a ragged L (2048 keys in 176-key tiles: 112 in the last; 100
    keys: one tile, 112 after rounding to 16) runs its P V over `last` keys, not block_n, and its softmax over as many
    columns, masked; the full tiles have no masked softmax. Its S stays block_n wide (narrower, ptxas serialized the
    wgmmas of some sets); tail=0 (outside the space) runs every tile at block_n; L a multiple of block_n has no tail."""
    s = normalize(dict(BASE, heads=32, kv_heads=32, seq_q=256, seq_k=seq_k, causal=False))
    knobs = dict(default_knobs(s), block_n=block_n, cluster=1)
    tail, whole = _source(s, knobs), _source(s, dict(knobs, tail=0))
    if not last:
        assert tail == whole
        return
    steps, per = block_n // 16, block_n // 2 + 2  # P V's k16 steps a tile; exponentials a softmax (+ 2 rows' alpha)
    # (each count is one more: the helper's declaration)
    pv, ex2 = tail.count("tvm_builtin_ptx_wgmma_f16_rs_mma_async") - 1, tail.count("tvmfuse_ex2(") - 1
    pv0, ex20 = whole.count("tvm_builtin_ptx_wgmma_f16_rs_mma_async") - 1, whole.count("tvmfuse_ex2(") - 1
    if seq_k > block_n:  # tile 0's softmax; the loop over the full tiles (P V of the tile before, S, softmax
        # unmasked), the peeled tail tile (P V of the tile before, its masked softmax), the tail's P V after the loop
        assert (pv, ex2) == (2 * steps + last // 16, 2 * per + last // 2 + 2)
        assert (pv0, ex20) == (2 * steps, 3 * per)  # without: the loop's softmax masked and not, P V at block_n
    else:  # one tile: its masked softmax and its P V
        assert (pv, ex2) == (last // 16, last // 2 + 2) and (pv0, ex20) == (steps, per)


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_tma_store_stages_each_consumers_rows_in_q_and_stores_them_by_panel(layout):
    """tma_store (the default for BHSD and BSHD outputs, both run on a GPU): the output goes through Q's buffer, written
    128-byte swizzled, and leaves by one TMA store a 64-wide panel a consumer (the tensor map's box: 64 rows), once
    every write is fenced for the async proxy and the consumer's warps meet; the CTA waits for the stores to read
    shared memory before it ends. Refused with persistent CTAs (the next Q loads into that buffer)."""
    s = normalize(dict(batch=1, heads=4, kv_heads=4, seq_q=300, seq_k=512, head_dim=128, dtype="float16",
                       causal=False, arch="sm_90a", q_layout=layout, out_layout=layout))
    knobs = dict(default_knobs(s), tma_store=1)
    src, plain = _source(s, knobs), _source(s, dict(knobs, tma_store=0))
    assert _source(s, default_knobs(s)) == src
    store = "tvm_builtin_ptx_cp_async_bulk_tensor_s2g_async_bulk_tensor_4d_global_shared__cta_bulk_group("
    assert src.count(store) == 1 + 2 and store not in plain  # the helper; the two panels
    assert "const __grid_constant__ CUtensorMap o_map" in src and "o_map" not in plain
    assert src.count("tvm_builtin_ptx_cp_async_bulk_wait_group_async_bulk_wait_group_read_0()") == 1 + 1
    assert src.count("tvmfuse_store_half2(") == plain.count("tvmfuse_store_half2(")  # the same 64 pairs, into Q
    assert src.count("tvmfuse_bar_sync(") == plain.count("tvmfuse_bar_sync(") + 1  # each consumer's warps meet
    fence = "fence_proxy_proxy_async_shared__cta();"  # the writes, visible to the TMA engine
    assert src.count(fence) == plain.count(fence) + 1
    fn = ATTENTION_PREFILL_WGMMA(s, knobs)
    box = "64, 64, 1, 1, 1, 1, 1, 1, 0, 3, 3, 0" if layout == "BHSD" else "64, 1, 64, 1, 1, 1, 1, 1, 0, 3, 3, 0"
    assert fn.script().count(box) == 1  # the output's map: 64 of D x 64 rows, 128-byte swizzle
    with pytest.raises(ValueError, match="persistent CTAs"):
        ATTENTION_PREFILL_WGMMA(s, dict(knobs, persistent=1, cluster=1, tma_store=1))
    assert store not in _source(s, dict(default_knobs(s), persistent=1, cluster=1))  # persistent: off by default
    if shutil.which("nvcc"):
        assert len(_nvcc(src)) > 1000


def test_chained_items_issue_the_next_s_before_storing_and_load_q_into_two_buffers():
    """chain (persistent, overlapped, no ping-pong, not causal): Q has two buffers (q_full[2]), the next item's first
    S is issued after this item's last P V (8 more k16 S wgmmas than persistent alone: a third issue site) and waited
    for only after the output is stored; ptxas serializes no wgmma; it refuses what it cannot do."""
    s = normalize(dict(BASE, heads=32, kv_heads=32, seq_q=2048, seq_k=2048, causal=False))  # 512 query tiles
    knobs = dict(default_knobs(s), block_n=128, pingpong=0, cluster=1, persistent=1)
    plain, chained = _source(s, knobs), _source(s, dict(knobs, chain=1))
    ss = "tvm_builtin_ptx_wgmma_f16_ss_mma_async"
    assert chained.count(ss) == plain.count(ss) + 8  # head dim 128: 8 k16 steps a S
    assert "uint64_t q_full_ptr[2];" in chained and "uint64_t q_full_ptr[1];" in plain
    last_wait = chained.rindex("tvm_builtin_ptx_wgmma_wait_group_wait_group_sync_aligned_1();")
    assert last_wait < chained.index("tvmfuse_store_half2((&(out")  # S in flight while the output is stored
    for bad, why in ((dict(knobs, persistent=0), "chain needs persistent CTAs"),
                     (dict(knobs, pingpong=1), "chain needs persistent CTAs"),
                     (dict(knobs, order=0, causal=True), "and no causality"),
                     (dict(knobs, block_n=176), "2 Q buffers and 2 stages of 176 keys take more than")):
        causal = bad.pop("causal", False)
        with pytest.raises(ValueError, match=why):
            ATTENTION_PREFILL_WGMMA(normalize(dict(s, causal=causal)), dict(bad, chain=1))
    if shutil.which("nvcc"):
        code, said = ptxas_report(chained)
        assert code == 0 and "serialized" not in said, said[-2000:]


@pytest.mark.skipif(not shutil.which("nvcc"), reason="needs nvcc")
def test_ptxas_serializes_no_wgmma_of_the_default_knobs_at_the_benchmark_shapes():
    """ptxas reports where it gives up on the wgmma pipeline ("Potential Performance Loss": serialized wgmmas,
    setmaxnreg ignored); the default knob set at every benchmark shape (issue 25's and the models') has none. (At
    head dim 64, 64-key tiles do: C7508 + C7520, every such set; the default takes 128 keys.)"""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.attention import MODEL_CASES, WGMMA_CASES  # pylint: disable=import-outside-toplevel

    shapes = [normalize(dict(s, arch="sm_90a")) for _, _, s in WGMMA_CASES + MODEL_CASES if s["dtype"] == "float16"]

    def losses(s):
        return [ln for ln in ptxas_report(_source(s, default_knobs(s)))[1].splitlines()
                if "Potential Performance Loss" in ln]

    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        found = dict(zip([(s["heads"], s["head_dim"], s["seq_q"], s["causal"], s["kv_heads"]) for s in shapes],
                         pool.map(losses, shapes)))
    assert len(found) == 8 and not any(found.values()), found  # 9 shapes, one twice (causal 2048, 32 x 128)
