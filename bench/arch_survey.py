"""Which Hugging Face architectures a user's export builds and verifies: each tiny random model (2 layers, hidden
64, nothing downloaded) exported with input_ids alone by both torch.onnx exporters, then `tune --target llvm
--trials 0`; per export: the exit code, the verification against onnxruntime and what was fused. CPU only.

    python bench/arch_survey.py --out bench/results/arch_survey_cpu.json [--only qwen3,gemma2] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=256,
              max_position_embeddings=128)
#: name -> (model class, config class, config fields beyond COMMON; None: the config takes its own names), or None:
#: the tests' model of that name (tests/hf_export.tiny_model, the same sizes)
ARCHS = {
    "qwen3": None,
    "gemma2": None,
    "gemma3": None,
    "phi3": None,
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(num_key_value_heads=2)),
    "llama3": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(partial_rotary_factor=0.5)),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", dict(num_key_value_heads=2)),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(num_key_value_heads=2)),
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(num_key_value_heads=2)),
    "falcon": ("FalconForCausalLM", "FalconConfig", None),
    "gpt_bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig", None),
    "roberta": ("RobertaModel", "RobertaConfig", dict()),
    "distilbert": ("DistilBertModel", "DistilBertConfig", None),
}
#: the configs that name their sizes their own way
OWN_NAMES = {
    "falcon": dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4, hidden_size=64, multi_query=True,
                   new_decoder_architecture=False),
    "gpt_bigcode": dict(vocab_size=128, n_layer=2, n_head=4, n_embd=64, n_positions=128),
    "distilbert": dict(vocab_size=128, n_layers=2, n_heads=4, dim=64, hidden_dim=256, max_position_embeddings=128),
}


def tiny(name: str):
    """The randomly initialised model of `name` (seed 0); None for the tests' own (ARCHS)."""
    import torch  # pylint: disable=import-outside-toplevel
    import transformers as tf  # pylint: disable=import-outside-toplevel

    if ARCHS[name] is None:
        return None
    model_cls, cfg_cls, extra = ARCHS[name]
    torch.manual_seed(0)
    fields = OWN_NAMES[name] if extra is None else {**COMMON, **extra}
    return getattr(tf, model_cls)(getattr(tf, cfg_cls)(**fields))


def survey(name: str, exporter: str, work: str) -> dict:
    """Export `name` with `exporter`, build it with the CLI (a fresh process), and read the manifest."""
    sys.path.insert(0, str(ROOT / "tests"))
    import hf_export  # pylint: disable=import-outside-toplevel

    row = {"arch": name, "exporter": exporter}
    os.makedirs(work, exist_ok=True)
    try:
        path = hf_export.export(name, exporter, work, ids_only=True, model=tiny(name))
    except Exception as err:  # noqa: BLE001  (the exporter's failure is the row's finding)
        return {**row, "exported": False, "error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200]}"}
    out, started = os.path.join(work, "out"), time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune.py"), path, "--target", "llvm", "--trials", "0",
                           "--out", out, "--logs", os.path.join(work, "logs"), "--schedules", "none"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    row.update(exported=True, exit=proc.returncode, build_s=round(time.time() - started, 1))
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    if errors:
        row["error"] = errors[0]
    manifest = Path(out) / f"{Path(path).stem}-llvm" / "manifest.json"
    if manifest.exists():
        m = json.loads(manifest.read_text())
        row.update(verification=m["verification"].get("status"), max_abs_err=m["verification"].get("max_abs_err"),
                   kernels=len(m["kernels"]), launches=m["fusion"]["launches_after"],
                   fused=m["fusion"]["kept_by_pattern"], failures=m["failures"])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--only", default="", help="comma-separated architectures (default: all of ARCHS)")
    ap.add_argument("--work", default=None, help="folder for the exports and builds (default: a temporary one)")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(ARCHS)
    unknown = [n for n in names if n not in ARCHS]
    if unknown:
        print(f"error: --only: unknown architectures {unknown} (known: {', '.join(ARCHS)})", file=sys.stderr)
        return 2
    work = args.work or tempfile.mkdtemp(prefix="arch_survey_")
    rows = []
    for name in names:
        for exporter in ("dynamo", "legacy"):
            rows.append(survey(name, exporter, work))
            r = rows[-1]
            print(f"{name:12} {exporter:7} exit {r.get('exit', '-')} {r.get('verification', r.get('error', ''))} "
                  f"{r.get('max_abs_err', '')} {r.get('fused', '')}", flush=True)
    command = " ".join(["python", "bench/arch_survey.py", *(sys.argv[1:] if argv is None else argv)])
    Path(args.out).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    return 0 if all(r.get("verification") == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
