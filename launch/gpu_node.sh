#!/usr/bin/env bash
# One machine with N GPUs: one `stare-jax train` process; JAX sees (and shards over) all N local GPUs.
# Run `launch/gpu_node.sh --help` for the options.
set -euo pipefail
# shellcheck source=launch/_common.sh
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<'EOF'
Usage: launch/gpu_node.sh --gpus N --config CFG --run-dir DIR [options] [--dry-run]

Runs, from the root of this checkout (set up with the CUDA steps of BUILD.md: jax[cuda12] in .venv):
  env CUDA_VISIBLE_DEVICES=0,...,N-1 .venv/bin/stare-jax train --config CFG --run-dir DIR --resume 2>&1 | tee -a LOG

Options:
  --gpus N          number of local GPUs to use (GPUs 0..N-1 unless --devices), N >= 1
  --devices LIST    explicit CUDA device ids, e.g. 4,5,6,7 (its length must equal --gpus)
  --config CFG      config file (relative to the checkout or absolute); checked against the GPUs first
                    (mesh divides the device count, batch splits over the data shards, context fits)
  --gpu-type T      A100, H100 (default), H200 or B200: the GPU model for that check
  --set KEY=VALUE   config override passed to stare-jax train (repeatable), e.g. --set model.path=/data/q7b
  --run-dir DIR     run directory (checkpoints, metrics, config.yaml); a local path or gs://...
  --no-resume       start fresh instead of resuming from the latest checkpoint in --run-dir
  --allow-config-change resuming: accept config changes beyond the operational keys (recorded in
                    RUN_DIR/config_changes.jsonl; without it a changed config is refused)
  --log FILE        log file (default logs/train.log in the checkout)
  --env KEY=VALUE   extra environment for the process (repeatable), e.g. XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
  --dry-run         print the commands, one per line, instead of running them
  -h, --help        this help
EOF
}

GPUS="" DEVICES="" CONFIG="" RUN_DIR="" RESUME=1 LOG="logs/train.log" GPU_TYPE="H100"
EXTRA_ENV=()
mapfile -d '' ARGS < <(split_eq "$@")
set -- ${ARGS[@]+"${ARGS[@]}"}
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --gpus) need_value "$@"; GPUS="$2"; shift 2 ;;
    --devices) need_value "$@"; DEVICES="$2"; shift 2 ;;
    --config) need_value "$@"; CONFIG="$2"; shift 2 ;;
    --set) need_value "$@"; add_override "$2"; shift 2 ;;
    --gpu-type) need_value "$@"; GPU_TYPE="$2"; shift 2 ;;
    --run-dir) need_value "$@"; RUN_DIR="$2"; shift 2 ;;
    --resume) RESUME=1; shift ;;
    --no-resume) RESUME=0; shift ;;
    --allow-config-change) ALLOW_CONFIG_CHANGE=1; shift ;;
    --log) need_value "$@"; LOG="$2"; shift 2 ;;
    --env) need_value "$@"; EXTRA_ENV+=("$2"); shift 2 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

# --- validation (nothing has been run yet) ---
[[ -n "$GPUS" ]] || die "--gpus is required (number of local GPUs, >= 1)"
check_pos_int --gpus "$GPUS"
if [[ -n "$DEVICES" ]]; then
  [[ "$DEVICES" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--devices must be a comma-separated list of GPU ids, got '$DEVICES'"
  IFS=, read -r -a _dev <<<"$DEVICES"
  [[ "${#_dev[@]}" == "$GPUS" ]] || die "--devices '$DEVICES' lists ${#_dev[@]} GPUs but --gpus is $GPUS"
else
  DEVICES="$(seq_csv "$GPUS")"
fi
check_config "$CONFIG"
check_gpu_type "$GPU_TYPE"
check_layout "$CONFIG" "${GPUS}x${GPU_TYPE}"
[[ -n "$RUN_DIR" ]] || die "--run-dir is required (local directory or gs://bucket/path)"
for kv in ${EXTRA_ENV[@]+"${EXTRA_ENV[@]}"}; do
  [[ "$kv" =~ ^[A-Za-z_][A-Za-z0-9_]*=.*$ ]] || die "--env must be KEY=VALUE, got '$kv'"
done
if [[ "$DRY_RUN" == 0 ]] && command -v nvidia-smi >/dev/null 2>&1; then
  have="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
  ((have >= GPUS)) || die "--gpus $GPUS but nvidia-smi lists $have GPU(s) on $(hostname)"
fi
[[ -x "$ROOT/.venv/bin/stare-jax" || "$DRY_RUN" == 1 ]] \
  || die "$ROOT/.venv/bin/stare-jax not found: set up the environment first (BUILD.md, CUDA GPUs)"

# --- commands ---
train_args "$CONFIG" "$RUN_DIR" "$RESUME"
run cd "$ROOT"
run mkdir -p "$(dirname "$LOG")"
run_tee "$LOG" env CUDA_VISIBLE_DEVICES="$DEVICES" ${EXTRA_ENV[@]+"${EXTRA_ENV[@]}"} .venv/bin/stare-jax "${TRAIN_ARGS[@]}"
