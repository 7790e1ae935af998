#!/bin/sh
# Profile bench/ncu_kernels.py's launches with Nsight Compute (the full section set, SASS-level warp sampling, the
# card's own clocks) and summarise them (bench/ncu_summary.py); run on the GPU machine:
#   sh bench/ncu.sh OUTDIR [--gemm SPEC ...] [--attention SPEC ...]
set -e
out=$1
shift
mkdir -p "$out"
ncu --profile-from-start off --clock-control none --set full --import-source no -f -o "$out/prof" \
    python3 bench/ncu_kernels.py --out "$out/labels.json" "$@"
ncu -i "$out/prof.ncu-rep" --page details --csv > "$out/details.csv" || true
ncu -i "$out/prof.ncu-rep" --page source --csv --print-source sass > "$out/source.csv" 2> "$out/source.err" || true
python3 bench/ncu_summary.py "$out/prof.ncu-rep" "$out/labels.json" --source "$out/source.csv" --out "$out/summary.json"
