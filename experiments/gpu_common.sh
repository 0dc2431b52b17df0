# Sourced by experiments/gpu_session.sh and experiments/gpu_followup.sh: the lent GPU machine's set-up, and `run`.
# OUT (default ./gpu-out) gets one log per step and gpu.txt (the device, torch and Triton versions).
set -u
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
# pdserve's folders become the one `pdserve` package by pyproject's mapping: an editable install, offline
# (the machine's setuptools builds it; no dependency is fetched).
python3 -m pip install -q --no-deps --no-build-isolation -e . || { echo "cannot install pdserve here"; exit 1; }
export PYTHONUNBUFFERED=1 PDSERVE_CACHE="${PDSERVE_CACHE:-/tmp/pdserve-cache}"
run() {  # name, timeout seconds, command...: never stops the script, whatever the step's exit
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "=== $name exit ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    | tee -a "$OUT/gpu.txt"
