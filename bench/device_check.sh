#!/usr/bin/env bash
# The device run issue 39 asks for, as one script: dry-run it on the CPU, then run it on the GPU machine.
#
#   DEVICE=cpu QUICK=1 bash bench/device_check.sh          # the dry run, minutes on 2 cores
#   DEVICE=cuda bash bench/device_check.sh                 # on the H200 (see ../shared/reference/gpu-how-to.md for
#                                                          # carrying transformers 5.24 and the SmolLM2 wheel)
#
# Each case writes its output under $OUT (default bench/device-out) as soon as it ends, under `timeout -s INT`, so
# a case that runs long loses only itself. MODEL defaults to smollm2 (the carried wheel's GGUF).
set -uo pipefail
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-smollm2}
OUT=${OUT:-bench/device-out}
QUICK=${QUICK:-0}
LIMIT=${LIMIT:-150}
mkdir -p "$OUT"
if [ "$QUICK" = 1 ]; then size=(--per-kind 1 --max-new-tokens 16); reps=(--reps 1); else size=(--per-kind 2); reps=(--reps 3); fi

run() {  # run NAME COMMAND...: stdout and stderr to $OUT/NAME.txt, the exit status and seconds appended
  local name=$1; shift
  local start=$SECONDS
  timeout -s INT "$LIMIT" "$@" > "$OUT/$name.txt" 2>&1
  echo "[exit $? after $((SECONDS - start)) s] $*" >> "$OUT/$name.txt"
  tail -n 3 "$OUT/$name.txt"
}

python - <<'PY' > "$OUT/env.txt" 2>&1
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
print("devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
cat "$OUT/env.txt"
run tests python -m pytest -q -p no:cacheprovider tests/test_devices.py
for dtype in bfloat16 float16 float32; do
  run "profile_$dtype" python bench/profile_step.py --model "$MODEL" --device "$DEVICE" --dtype "$dtype" "${reps[@]}"
done
run bench python -m lattice_inference.cli bench --model "$MODEL" --device "$DEVICE" --methods greedy,ngram,suffix "${size[@]}" --json
run peers python bench/bench_peers.py --model "$MODEL" --device "$DEVICE" --no-vllm "${size[@]}" "${reps[@]}" --json "$OUT/peers.json"
