#!/usr/bin/env bash
# Several GPU machines, one `stare-jax train` process per machine (each sees all its local GPUs), joined by
# jax.distributed: (a) under Slurm (writes and submits an sbatch script) or (b) over plain ssh.
# Run `launch/gpu_multinode.sh --help` for the options.
set -euo pipefail
# shellcheck source=launch/_common.sh
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<'EOF'
Usage:
  launch/gpu_multinode.sh --mode slurm --nodes N --gpus-per-node G --config CFG --run-dir DIR [slurm options]
  launch/gpu_multinode.sh --mode ssh --hosts h0,h1,... --nodes N --gpus-per-node G --coordinator-address h0:PORT
                          --config CFG --run-dir DIR [ssh options]
  add --dry-run to print the commands (one per line) instead of running them.

Every process runs, from the checkout (the same path on every node: a shared filesystem, or --remote-dir):
  .venv/bin/stare-jax train --config CFG --run-dir DIR --resume
      --coordinator-address HOST:PORT --num-processes N --process-id I
with JAX_LOCAL_DEVICE_IDS=0,...,G-1 so that each process uses all G GPUs of its node. --run-dir must be storage
that every node sees (shared filesystem or gs://).

Common options:
  --mode slurm|ssh          launcher
  --nodes N                 number of nodes = processes (N >= 1)
  --gpus-per-node G         GPUs per node (G >= 1)
  --config CFG              config file (relative to the checkout or absolute); checked against the cluster
                            first (mesh divides the device count, batch splits over the data shards, context fits)
  --gpu-type T              A100, H100 (default), H200 or B200: the GPU model for that check
  --set KEY=VALUE           config override passed to stare-jax train (repeatable), e.g. --set
                            sampling.max_prompts_per_call=32 (what the paper configs' GPU alternatives need)
  --run-dir DIR             run directory seen by every node
  --no-resume               start fresh instead of resuming from the latest checkpoint in --run-dir
  --allow-config-change     resuming: accept config changes beyond the operational keys (recorded in
                            RUN_DIR/config_changes.jsonl; without it a changed config is refused)
  --port PORT               coordinator port (slurm; default: derived from the job id like jax's Slurm detector)

Slurm options (the script is written to logs/slurm/JOB.sbatch and submitted with sbatch):
  --job-name NAME           default stare-jax
  --partition P, --account A, --time T (e.g. 48:00:00), --cpus-per-task C   passed as #SBATCH lines
  --no-submit               write the script but do not submit it

ssh options:
  --hosts h0,h1,...         hosts in process-id order (process i runs on host i); or --hostfile FILE (one a line)
  --coordinator-address H:P the address of process 0 (on host 0), reachable from every host
  --remote-dir DIR          checkout on the hosts (default: this checkout's path)
  --ssh-opt OPT             extra ssh option (repeatable), e.g. --ssh-opt -p --ssh-opt 2222

  -h, --help                this help

What jax 0.10.2 reads: jax.distributed.initialize() takes the coordinator from JAX_COORDINATOR_ADDRESS and local
devices from JAX_LOCAL_DEVICE_IDS; under Slurm its SlurmCluster detector fills the rest from SLURM_NTASKS
(process count), SLURM_PROCID (process id) and SLURM_STEP_NODELIST (+ JAX_COORDINATOR_PORT). Without
JAX_LOCAL_DEVICE_IDS that detector would restrict each process to GPU $SLURM_LOCALID only (one process per GPU);
with --ntasks-per-node=1 that is GPU 0, so the scripts set JAX_LOCAL_DEVICE_IDS explicitly.
JAX_NUM_PROCESSES / JAX_PROCESS_ID are exported for stare_jax's own use; jax itself does not read them.
EOF
}

MODE="" NODES="" GPN="" GPU_TYPE="H100" CONFIG="" RUN_DIR="" RESUME=1 PORT="" JOB="stare-jax" PARTITION="" ACCOUNT="" TIME=""
CPT="" SUBMIT=1 HOSTS="" HOSTFILE="" COORD="" REMOTE_DIR="$ROOT"
SSH_OPTS=()
mapfile -d '' ARGS < <(split_eq "$@")
set -- ${ARGS[@]+"${ARGS[@]}"}
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --mode) need_value "$@"; MODE="$2"; shift 2 ;;
    --nodes) need_value "$@"; NODES="$2"; shift 2 ;;
    --gpus-per-node) need_value "$@"; GPN="$2"; shift 2 ;;
    --config) need_value "$@"; CONFIG="$2"; shift 2 ;;
    --set) need_value "$@"; add_override "$2"; shift 2 ;;
    --gpu-type) need_value "$@"; GPU_TYPE="$2"; shift 2 ;;
    --run-dir) need_value "$@"; RUN_DIR="$2"; shift 2 ;;
    --resume) RESUME=1; shift ;;
    --no-resume) RESUME=0; shift ;;
    --allow-config-change) ALLOW_CONFIG_CHANGE=1; shift ;;
    --port) need_value "$@"; PORT="$2"; shift 2 ;;
    --job-name) need_value "$@"; JOB="$2"; shift 2 ;;
    --partition) need_value "$@"; PARTITION="$2"; shift 2 ;;
    --account) need_value "$@"; ACCOUNT="$2"; shift 2 ;;
    --time) need_value "$@"; TIME="$2"; shift 2 ;;
    --cpus-per-task) need_value "$@"; CPT="$2"; shift 2 ;;
    --no-submit) SUBMIT=0; shift ;;
    --hosts) need_value "$@"; HOSTS="$2"; shift 2 ;;
    --hostfile) need_value "$@"; HOSTFILE="$2"; shift 2 ;;
    --coordinator-address) need_value "$@"; COORD="$2"; shift 2 ;;
    --remote-dir) need_value "$@"; REMOTE_DIR="$2"; shift 2 ;;
    --ssh-opt)
      [[ $# -ge 2 && -n "$2" ]] || die "option --ssh-opt needs a value"
      SSH_OPTS+=("$2"); shift 2 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

# --- validation (nothing has been run yet) ---
case "$MODE" in
  slurm | ssh) ;;
  "") die "--mode is required: slurm or ssh" ;;
  *) die "--mode must be slurm or ssh, got '$MODE'" ;;
esac
if [[ "$MODE" == ssh && -z "$NODES" && ( -n "$HOSTS" || -n "$HOSTFILE" ) ]]; then
  :  # --nodes defaults to the number of hosts below
else
  [[ -n "$NODES" ]] || die "--nodes is required (number of nodes, >= 1)"
  check_pos_int --nodes "$NODES"
fi
[[ -n "$GPN" ]] || die "--gpus-per-node is required (GPUs per node, >= 1)"
check_pos_int --gpus-per-node "$GPN"
check_config "$CONFIG"
check_word --config "$CONFIG"
[[ -n "$RUN_DIR" ]] || die "--run-dir is required (shared filesystem path or gs://bucket/path)"
check_word --run-dir "$RUN_DIR"
[[ -z "$PORT" ]] || { check_pos_int --port "$PORT"; ((PORT <= 65535)) || die "--port must be in 1..65535, got '$PORT'"; }
LOCAL_IDS="$(seq_csv "$GPN")"
train_args "$CONFIG" "$RUN_DIR" "$RESUME"

if [[ "$MODE" == slurm ]]; then
  [[ -z "$HOSTS$HOSTFILE$COORD" ]] || die "--hosts/--hostfile/--coordinator-address are for --mode ssh; Slurm picks the nodes"
  [[ "$JOB" =~ ^[A-Za-z0-9_.-]+$ ]] || die "--job-name '$JOB' may only contain letters, digits and _ . -"
  for pair in "--partition:$PARTITION" "--account:$ACCOUNT" "--time:$TIME"; do
    [[ -z "${pair#*:}" ]] || check_word "${pair%%:*}" "${pair#*:}"
  done
  [[ -z "$CPT" ]] || check_pos_int --cpus-per-task "$CPT"
else
  [[ -z "$PARTITION$ACCOUNT$TIME$CPT$PORT" ]] || die "--partition/--account/--time/--cpus-per-task/--port are for --mode slurm"
  [[ -n "$HOSTS" || -n "$HOSTFILE" ]] || die "--mode ssh needs --hosts h0,h1,... or --hostfile FILE"
  [[ -z "$HOSTS" || -z "$HOSTFILE" ]] || die "give either --hosts or --hostfile, not both"
  HOST_LIST=()
  if [[ -n "$HOSTS" ]]; then
    IFS=, read -r -a HOST_LIST <<<"$HOSTS"
  else
    [[ -f "$HOSTFILE" ]] || die "--hostfile not found: $HOSTFILE"
    while read -r h _; do
      [[ -z "$h" || "$h" == \#* ]] || HOST_LIST+=("$h")
    done <"$HOSTFILE"
  fi
  [[ ${#HOST_LIST[@]} -gt 0 ]] || die "the hosts list is empty"
  for h in "${HOST_LIST[@]}"; do
    [[ "$h" =~ ^([A-Za-z0-9_.-]+@)?[A-Za-z0-9_.-]+$ ]] || die "host '$h' is not a host name ([user@]host)"
  done
  [[ -n "$NODES" ]] || NODES="${#HOST_LIST[@]}"
  [[ "${#HOST_LIST[@]}" == "$NODES" ]] \
    || die "--nodes is $NODES but the hosts list has ${#HOST_LIST[@]} host(s): ${HOST_LIST[*]}"
  [[ -n "$COORD" ]] || die "--mode ssh needs --coordinator-address HOST:PORT (process 0's host, e.g. ${HOST_LIST[0]#*@}:8476)"
  check_host_port --coordinator-address "$COORD"
  check_word --remote-dir "$REMOTE_DIR"
  if [[ "${COORD%:*}" != "${HOST_LIST[0]#*@}" ]]; then
    warn "--coordinator-address $COORD is not on ${HOST_LIST[0]} (host of process 0); it must be that host's address"
  fi
fi
check_gpu_type "$GPU_TYPE"
check_layout "$CONFIG" "${NODES}x${GPN}x${GPU_TYPE}"

# --- commands ---
if [[ "$MODE" == slurm ]]; then
  out_dir="logs/slurm"
  script="$out_dir/$JOB.sbatch"
  sb=("#!/usr/bin/env bash"
    "#SBATCH --job-name=$JOB"
    "#SBATCH --nodes=$NODES"
    "#SBATCH --ntasks-per-node=1"
    "#SBATCH --gpus-per-node=$GPN")
  [[ -z "$CPT" ]] || sb+=("#SBATCH --cpus-per-task=$CPT")
  [[ -z "$PARTITION" ]] || sb+=("#SBATCH --partition=$PARTITION")
  [[ -z "$ACCOUNT" ]] || sb+=("#SBATCH --account=$ACCOUNT")
  [[ -z "$TIME" ]] || sb+=("#SBATCH --time=$TIME")
  train="$(cmdline .venv/bin/stare-jax "${TRAIN_ARGS[@]}")"
  if [[ -n "$PORT" ]]; then
    port_line="export JAX_COORDINATOR_PORT=$PORT"
  else
    # shellcheck disable=SC2016  # expanded by the job: the port rule of jax's SlurmCluster detector
    port_line='export JAX_COORDINATOR_PORT="${JAX_COORDINATOR_PORT:-$((SLURM_JOB_ID % 4096 + 61440))}"'
  fi
  # shellcheck disable=SC2016  # $VARS below are expanded by the job, not here
  sb+=("#SBATCH --output=$out_dir/%x-%j.out"
    "# Written by launch/gpu_multinode.sh: one process per node, each on all $GPN local GPUs."
    "set -euo pipefail"
    "cd $(shq "$ROOT")"
    'head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"  # not head: SIGPIPE under pipefail'
    "$port_line"
    'export JAX_COORDINATOR_ADDRESS="$head_node:$JAX_COORDINATOR_PORT"'
    'export JAX_NUM_PROCESSES="$SLURM_NNODES"'
    "export JAX_LOCAL_DEVICE_IDS=$LOCAL_IDS"
    "srun --nodes=$NODES --ntasks-per-node=1 --gpus-per-node=$GPN --kill-on-bad-exit=1 --output=$out_dir/%x-%j-proc%t.log bash -c 'export JAX_PROCESS_ID=\"\$SLURM_PROCID\"; exec $train --coordinator-address \"\$JAX_COORDINATOR_ADDRESS\" --num-processes \"\$SLURM_NTASKS\" --process-id \"\$SLURM_PROCID\"'")
  content="$(printf '%s\n' "${sb[@]}")"
  run cd "$ROOT"
  run mkdir -p "$out_dir"
  write_file "$script" "$content"
  if [[ $SUBMIT == 1 ]]; then
    run sbatch "$script"
  else
    info "wrote $ROOT/$script (not submitted: --no-submit)"
  fi
else
  for ((i = 0; i < NODES; i++)); do
    train="$(cmdline .venv/bin/stare-jax "${TRAIN_ARGS[@]}" --coordinator-address "$COORD" --num-processes "$NODES" --process-id "$i")"
    remote="cd $(shq "$REMOTE_DIR") && mkdir -p logs && { nohup env JAX_LOCAL_DEVICE_IDS=$LOCAL_IDS $train > logs/train-proc$i.log 2>&1 < /dev/null & echo \$! > logs/train-proc$i.pid; }"
    run ssh ${SSH_OPTS[@]+"${SSH_OPTS[@]}"} -o BatchMode=yes "${HOST_LIST[$i]}" "$remote"
  done
  [[ "$DRY_RUN" == 1 ]] || info "started $NODES processes; logs: $REMOTE_DIR/logs/train-proc<i>.log on each host"
fi
