#!/usr/bin/env bash
# The GPU checks a session lent a device machine makes, as one prepared command (about 6 to 8
# minutes on one H200; every check has its own time limit, so the whole stays under 9):
#
#   bash benchmarks/gpu_session.sh                  # on the GPU machine, from the repository root
#   ACCELERATOR=cpu bash benchmarks/gpu_session.sh  # a dry run of the script itself, on CPU
#
# 1-4. benchmarks/gpu_check.py: plain (one learner, default group NCCL), two learners on one GPU
#      (default group gloo with CUDA tensors: central, collective, sharded), the same in
#      bf16-mixed, and with AdamW and a checkpoint every 20 updates (the owners' state gathered);
# 5.   benchmarks/scaling.py on one GPU at 1M, 4M, 16M and 64M parameters against ddp.
# A failed check does not stop the others; the script exits non-zero if any failed. Each
# benchmark writes its own results files (benchmarks/results); the logs go to $OUT where the
# device tool sets it, else to benchmarks/results/gpu_session. On CPU, two learner processes
# stand in for "two learners on one GPU" and the sizes are small: it checks the script, not GPUs.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
accelerator="${ACCELERATOR:-gpu}"
logs="${OUT:-benchmarks/results/gpu_session}"
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
python=$(command -v python3 || command -v python)

if ! "$python" -c "import lightning_stale, pytorch_lightning" 2>"$logs/import.log"; then
    echo "gpu_session: lightning_stale does not import here (see $logs/import.log): install it"
    echo "  (pip install -e . --no-deps, with hydra-core and omegaconf carried as wheels where absent)"
    exit 2
fi
"$python" - <<'PY' | tee "$logs/versions.txt"
import torch, pytorch_lightning
cuda = torch.cuda.is_available()
print("torch", torch.__version__, "| lightning", pytorch_lightning.__version__,
      "| NCCL", ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-",
      "| GPUs", torch.cuda.device_count(), torch.cuda.get_device_name(0) if cuda else "")
PY

if [ "$accelerator" = gpu ]; then
    check=(benchmarks/gpu_check.py --accelerator gpu --devices 1)
    two=(--learners-per-gpu 2)
    scaling=(benchmarks/scaling.py --accelerator gpu --devices 1 --sizes 1M 4M 16M 64M
             --modes ddp sync async k_batch_async --repeats 2)
else
    check=(benchmarks/gpu_check.py --accelerator cpu --devices 1 --updates 20)
    two=(--devices 2)
    scaling=(benchmarks/scaling.py --accelerator cpu --devices 1 --sizes 0.02M 1M
             --modes ddp sync async k_batch_async --repeats 1 --steps 20)
fi

failed=()
run() {  # name, time limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    echo "== $name: $*"
    timeout --kill-after=10 "$limit" "$python" "$@" >"$logs/$name.log" 2>&1
    local status=$?
    tail -n 3 "$logs/$name.log"
    echo "== $name: exit $status after $((SECONDS - started)) s"
    [ "$status" -eq 0 ] || failed+=("$name (exit $status)")
}

run plain 90 "${check[@]}"
run two_learners 150 "${check[@]}" "${two[@]}"
run two_learners_bf16 150 "${check[@]}" "${two[@]}" --precision bf16-mixed
run adamw_checkpoints 90 "${check[@]}" --optimizer adamw --checkpoint-every 20
run scaling 240 "${scaling[@]}"

if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_session: failed: ${failed[*]}"
    exit 1
fi
echo "gpu_session: every check passed ($accelerator)"
