#!/usr/bin/env bash
# Cloud TPU VM / pod slice launcher for stare_jax (wraps `gcloud compute tpus ...`).
# Run `launch/tpu_vm.sh --help` for the subcommands and options.
set -euo pipefail
# shellcheck source=launch/_common.sh
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<'EOF'
Usage: launch/tpu_vm.sh SUBCOMMAND [options] [--dry-run]

Subcommands (typical order: create -> sync -> setup -> run -> logs ... -> delete):
  create   create the TPU VM (or a queued resource with --queued) for --accelerator-type
  sync     copy this checkout to every worker (tarball + scp), or --repo URL --ref REF (git on every worker)
  setup    on every worker: Python venv + pip install -c constraints.txt -r requirements.txt + jax[tpu] + stare_jax
  run      on every worker: stare-jax train --config CFG --run-dir DIR --resume, detached, log per worker
  logs     follow one worker's training log (--worker N, default 0)
  watch    (spot/preemptible) loop: if the slice is PREEMPTED/SUSPENDED/FAILED/gone, delete + create + sync +
           setup + run (which resumes from the latest checkpoint); stop when worker 0 reports the run finished
  stop     stop the training process on every worker (--vm: stop the VM itself; single-host, non-queued only)
  delete   delete the TPU VM (or the queued resource and its node with --queued)
  info     print what an accelerator type means: family, chips, workers (hosts), default runtime version

Options:
  --name NAME               TPU node name (required except for info); the queued resource is NAME-qr
  --zone ZONE               e.g. us-east5-a (required except for info)
  --project PROJECT         gcloud project (default: gcloud's configured project)
  --accelerator-type TYPE   v4-<cores>, v5p-<cores>, v5litepod-<chips> (v5e), v6e-<chips>; required by
                            create, watch and info
  --version RUNTIME         TPU software version (default: from the type, see below)
  --spot | --preemptible    capacity that can be reclaimed (--preemptible is not accepted with --queued)
  --queued                  use a queued resource (gcloud compute tpus queued-resources) instead of tpu-vm create
  --config CFG              config file, relative to the checkout (run, watch; with create: only checked
                            against --accelerator-type)
  --set KEY=VALUE           config override passed to stare-jax train (repeatable), e.g. --set
                            model.path=/data/Qwen2.5-Math-7B --set data.train_path=gs://BUCKET/train.jsonl
  --run-dir DIR             gs://bucket/path (needed on multi-host slices: every worker must see the checkpoints)
                            or a directory on each worker (run, watch)
  --no-resume               start fresh instead of resuming from the latest checkpoint in --run-dir
  --allow-config-change     resuming: accept config changes beyond the operational keys (recorded in
                            RUN_DIR/config_changes.jsonl; without it a changed config is refused)
  --repo URL --ref REF      sync with git (clone once, then fetch + checkout REF) instead of copying this checkout
  --remote-dir DIR          checkout directory on the workers (default stare_jax, i.e. ~/stare_jax)
  --python PY               Python >= 3.11 used for the venv on the workers (default python3.11; installed
                            with apt when missing)
  --worker N                worker for logs (default 0)
  --lines N                 logs: lines of history to show (default 100); --no-follow: print and exit
  --interval SECONDS        watch: seconds between checks (default 300)
  --max-recoveries N        watch: give up after N re-creations (default 20)
  --vm                      stop: stop the VM itself instead of the training process
  --dry-run                 print the commands, one per line, instead of running them
  -h, --help                this help

Accelerator types, hosts and default runtime versions (Cloud TPU documentation, "TPU versions" pages):
  v4-N        N = TensorCores (2 per chip), 4 chips per host: chips = N/2, workers = N/8 (N a multiple of 8)
              runtime tpu-ubuntu2204-base
  v5p-N       N = TensorCores (2 per chip), 4 chips per host: chips = N/2, workers = N/8 (N a multiple of 8)
              runtime v2-alpha-tpuv5             (e.g. v5p-64 = 32 chips on 8 workers)
  v5litepod-N N = chips (v5e); N in 1 4 8 16 32 64 128 256; N <= 8 is one worker, larger slices have
              4 chips per worker VM: workers = N/4 (v5litepod-16 = 4 workers)       runtime v2-alpha-tpuv5-lite
  v6e-N       N = chips; N in 1 4 8 16 32 64 128 256; N <= 8 is one worker, larger slices have 4 chips per
              worker VM: workers = N/4 (v6e-256 = 64 workers)                       runtime v2-alpha-tpuv6e
  JAX sees one device per chip (v4/v5p megacore). jax.distributed.initialize() needs no arguments on TPU VMs.

The training command on each worker is
  .venv/bin/stare-jax train --config CFG --run-dir DIR --resume
started with nohup; its log is ~/stare_jax/logs/train-<hostname>.log, its pid logs/train.pid and its exit
status logs/train.exit on each worker.
EOF
}

# ---------------------------------------------------------------------------------------------------------------
# Accelerator types.

TPU_FAMILIES="v4-<cores> (e.g. v4-32), v5p-<cores> (e.g. v5p-64), v5litepod-<chips> (v5e, e.g. v5litepod-16), v6e-<chips> (e.g. v6e-16)"

# parse_accelerator TYPE: sets TPU_FAMILY, TPU_CHIPS, TPU_WORKERS, TPU_RUNTIME or dies naming TYPE.
parse_accelerator() {
  local t="$1" n unit
  case "$t" in
    v4-*) TPU_FAMILY=v4 n="${t#v4-}" unit=cores TPU_RUNTIME=tpu-ubuntu2204-base ;;
    v5p-*) TPU_FAMILY=v5p n="${t#v5p-}" unit=cores TPU_RUNTIME=v2-alpha-tpuv5 ;;
    v5litepod-*) TPU_FAMILY=v5e n="${t#v5litepod-}" unit=chips TPU_RUNTIME=v2-alpha-tpuv5-lite ;;
    v6e-*) TPU_FAMILY=v6e n="${t#v6e-}" unit=chips TPU_RUNTIME=v2-alpha-tpuv6e ;;
    v5e-*) die "unknown accelerator type '$t': v5e slices are named v5litepod-<chips>; accepted families: $TPU_FAMILIES" ;;
    *) die "unknown accelerator type '$t'; accepted families: $TPU_FAMILIES" ;;
  esac
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "accelerator type '$t': '$n' is not a positive $unit count; accepted families: $TPU_FAMILIES"
  if [[ "$unit" == cores ]]; then
    ((n % 8 == 0)) || die "accelerator type '$t': $TPU_FAMILY sizes count TensorCores and are multiples of 8 (4 chips x 2 cores per host), e.g. ${TPU_FAMILY}-8, ${TPU_FAMILY}-64"
    TPU_CHIPS=$((n / 2))
    TPU_WORKERS=$((n / 8))
  else
    case "$n" in
      1 | 4 | 8) TPU_CHIPS=$n TPU_WORKERS=1 ;;
      16 | 32 | 64 | 128 | 256) TPU_CHIPS=$n TPU_WORKERS=$((n / 4)) ;;
      *) die "accelerator type '$t': $TPU_FAMILY slices have 1, 4, 8, 16, 32, 64, 128 or 256 chips" ;;
    esac
  fi
}

# ---------------------------------------------------------------------------------------------------------------
# Arguments.

SUB="${1:-}"
case "$SUB" in
  -h | --help | help)
    usage
    exit 0
    ;;
  create | setup | sync | run | logs | watch | stop | delete | info) shift ;;
  "") die "missing subcommand; one of create, setup, sync, run, logs, watch, stop, delete, info (see --help)" ;;
  *) die "unknown subcommand '$SUB'; one of create, setup, sync, run, logs, watch, stop, delete, info (see --help)" ;;
esac

NAME="" ZONE="" PROJECT="" ACCEL="" VERSION="" SPOT=0 PREEMPTIBLE=0 QUEUED=0 CONFIG="" RUN_DIR="" RESUME=1
REPO="" REF="" REMOTE_DIR="stare_jax" PY="python3.11" WORKER=0 LINES=100 FOLLOW=1 INTERVAL=300 MAX_RECOVERIES=20
STOP_VM=0

mapfile -d '' ARGS < <(split_eq "$@")
set -- ${ARGS[@]+"${ARGS[@]}"}
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --name) need_value "$@"; NAME="$2"; shift 2 ;;
    --zone) need_value "$@"; ZONE="$2"; shift 2 ;;
    --project) need_value "$@"; PROJECT="$2"; shift 2 ;;
    --accelerator-type) need_value "$@"; ACCEL="$2"; shift 2 ;;
    --version) need_value "$@"; VERSION="$2"; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --preemptible) PREEMPTIBLE=1; shift ;;
    --queued) QUEUED=1; shift ;;
    --config) need_value "$@"; CONFIG="$2"; shift 2 ;;
    --set) need_value "$@"; add_override "$2"; shift 2 ;;
    --run-dir) need_value "$@"; RUN_DIR="$2"; shift 2 ;;
    --resume) RESUME=1; shift ;;
    --no-resume) RESUME=0; shift ;;
    --allow-config-change) ALLOW_CONFIG_CHANGE=1; shift ;;
    --repo) need_value "$@"; REPO="$2"; shift 2 ;;
    --ref) need_value "$@"; REF="$2"; shift 2 ;;
    --remote-dir) need_value "$@"; REMOTE_DIR="$2"; shift 2 ;;
    --python) need_value "$@"; PY="$2"; shift 2 ;;
    --worker) need_value "$@"; WORKER="$2"; shift 2 ;;
    --lines) need_value "$@"; LINES="$2"; shift 2 ;;
    --no-follow) FOLLOW=0; shift ;;
    --interval) need_value "$@"; INTERVAL="$2"; shift 2 ;;
    --max-recoveries) need_value "$@"; MAX_RECOVERIES="$2"; shift 2 ;;
    --vm) STOP_VM=1; shift ;;
    *) die "unknown option '$1' for '$SUB' (see --help)" ;;
  esac
done

# --- validation (nothing has been run yet) ---
if [[ -n "$ACCEL" ]]; then
  parse_accelerator "$ACCEL"
fi
if [[ "$SUB" == info ]]; then
  [[ -n "$ACCEL" ]] || die "info needs --accelerator-type"
  printf 'accelerator %s: family %s, chips %s, workers %s, runtime %s\n' \
    "$ACCEL" "$TPU_FAMILY" "$TPU_CHIPS" "$TPU_WORKERS" "$TPU_RUNTIME"
  exit 0
fi
[[ -n "$NAME" ]] || die "--name is required for '$SUB'"
[[ "$NAME" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] \
  || die "--name '$NAME' is not a valid TPU name (lowercase letters, digits and -, starting with a letter)"
[[ -n "$ZONE" ]] || die "--zone is required for '$SUB' (e.g. us-east5-a)"
[[ "$ZONE" =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || die "--zone '$ZONE' does not look like a zone (e.g. us-east5-a)"
[[ -z "$PROJECT" ]] || check_word --project "$PROJECT"
[[ -z "$VERSION" ]] || check_word --version "$VERSION"
check_word --remote-dir "$REMOTE_DIR"
check_word --python "$PY"
if [[ $SPOT == 1 && $PREEMPTIBLE == 1 ]]; then die "--spot and --preemptible exclude each other"; fi
if [[ $QUEUED == 1 && $PREEMPTIBLE == 1 ]]; then
  die "--preemptible is not accepted for queued resources; use --spot"
fi
if [[ -n "$REPO$REF" ]]; then
  [[ -n "$REPO" && -n "$REF" ]] || die "--repo and --ref go together (git URL and branch/tag/commit)"
  check_word --repo "$REPO"
  check_word --ref "$REF"
fi
case "$SUB" in
  create | watch)
    [[ -n "$ACCEL" ]] || die "'$SUB' needs --accelerator-type (accepted families: $TPU_FAMILIES)"
    ;;
esac
case "$SUB" in
  run | watch)
    check_config "$CONFIG"
    check_word --config "$CONFIG"
    [[ -n "$RUN_DIR" ]] || die "--run-dir is required for '$SUB' (gs://bucket/path, or a directory on every worker)"
    check_word --run-dir "$RUN_DIR"
    if [[ -n "$ACCEL" && "$TPU_WORKERS" -gt 1 && "$RUN_DIR" != gs://* ]]; then
      warn "--run-dir '$RUN_DIR' is not on GCS but $ACCEL has $TPU_WORKERS workers; checkpoints must be on storage every worker sees"
    fi
    ;;
esac
case "$SUB" in
  create | run | watch)
    [[ -z "$CONFIG" ]] || { check_config "$CONFIG"; check_layout "$CONFIG" "$ACCEL"; }
    ;;
esac
case "$SUB" in
  logs)
    [[ "$WORKER" =~ ^(0|[1-9][0-9]*)$ ]] || die "--worker must be a worker index 0, 1, ..., got '$WORKER'"
    if [[ -n "$ACCEL" ]] && ((WORKER >= TPU_WORKERS)); then
      die "--worker $WORKER is out of range: $ACCEL has workers 0..$((TPU_WORKERS - 1))"
    fi
    check_pos_int --lines "$LINES"
    ;;
  watch)
    check_pos_int --interval "$INTERVAL"
    check_pos_int --max-recoveries "$MAX_RECOVERIES"
    if [[ $SPOT == 0 && $PREEMPTIBLE == 0 ]]; then
      warn "watching an on-demand slice (no --spot/--preemptible): it is re-created only if it disappears or fails"
    fi
    ;;
  stop)
    if [[ $STOP_VM == 1 && $QUEUED == 1 ]]; then die "stop --vm: a queued resource cannot be stopped; use delete"; fi
    if [[ $STOP_VM == 1 && -n "$ACCEL" && "$TPU_WORKERS" -gt 1 ]]; then
      die "stop --vm: $ACCEL is a multi-host slice ($TPU_WORKERS workers), which cannot be stopped; use delete"
    fi
    ;;
esac
[[ -n "$VERSION" || -z "$ACCEL" ]] || VERSION="$TPU_RUNTIME"

# ---------------------------------------------------------------------------------------------------------------
# Commands.

QR="${NAME}-qr"
GC=(gcloud compute tpus)
LOC=(--zone="$ZONE")
[[ -z "$PROJECT" ]] || LOC+=(--project="$PROJECT")
# RDIR is expanded by the workers' shell: a literal "~/" is intended.
# shellcheck disable=SC2088
if [[ "$REMOTE_DIR" == /* || "$REMOTE_DIR" == "~"* ]]; then RDIR="$REMOTE_DIR"; else RDIR="~/$REMOTE_DIR"; fi

# ssh_all / ssh_one: a command on every worker / on one worker.
ssh_all() { run "${GC[@]}" tpu-vm ssh "$NAME" "${LOC[@]}" --worker=all --command "$1"; }
ssh_one() { run "${GC[@]}" tpu-vm ssh "$NAME" "${LOC[@]}" --worker="$1" --command "$2"; }

do_create() {
  if [[ $QUEUED == 1 ]]; then
    local cmd=("${GC[@]}" queued-resources create "$QR" --node-id="$NAME" "${LOC[@]}"
      --accelerator-type="$ACCEL" --runtime-version="$VERSION")
    [[ $SPOT == 0 ]] || cmd+=(--spot)
  else
    local cmd=("${GC[@]}" tpu-vm create "$NAME" "${LOC[@]}" --accelerator-type="$ACCEL" --version="$VERSION")
    [[ $SPOT == 0 ]] || cmd+=(--spot)
    [[ $PREEMPTIBLE == 0 ]] || cmd+=(--preemptible)
  fi
  run "${cmd[@]}"
}

do_delete() {
  if [[ $QUEUED == 1 ]]; then
    run "${GC[@]}" queued-resources delete "$QR" "${LOC[@]}" --force --quiet
  else
    run "${GC[@]}" tpu-vm delete "$NAME" "${LOC[@]}" --quiet
  fi
}

do_sync() {
  if [[ -n "$REPO" ]]; then
    ssh_all "if [ ! -d $RDIR/.git ]; then git clone --no-checkout $REPO $RDIR; fi && git -C $RDIR fetch --depth 1 origin $REF && git -C $RDIR checkout --force FETCH_HEAD"
  else
    local tarball="${TMPDIR:-/tmp}/stare_jax-${NAME}.tar.gz"
    run tar -czf "$tarball" --exclude=.git --exclude=.venv --exclude=.cache --exclude=.pytest_cache \
      --exclude=.notes --exclude=__pycache__ --exclude=*.egg-info --exclude=runs --exclude=logs --exclude=artifacts \
      -C "$ROOT" . || return 1
    run "${GC[@]}" tpu-vm scp "$tarball" "$NAME:stare_jax.tar.gz" "${LOC[@]}" --worker=all || return 1
    ssh_all "mkdir -p $RDIR && tar -xzf ~/stare_jax.tar.gz -C $RDIR && rm -f ~/stare_jax.tar.gz"
  fi
}

do_setup() {
  local jax_version
  jax_version="$(sed -n 's/^jax==//p' "$ROOT/constraints.txt" | head -n 1)"
  [[ -n "$jax_version" ]] || die "no 'jax==' pin in $ROOT/constraints.txt"
  ssh_all "set -e; test -f $RDIR/requirements.txt || { echo \"stare_jax is not in $RDIR on \$(hostname): run launch/tpu_vm.sh sync first\" >&2; exit 1; }; cd $RDIR; command -v $PY >/dev/null || { sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q $PY $PY-venv; }; test -x .venv/bin/python || $PY -m venv .venv; .venv/bin/pip install -q -U pip; .venv/bin/pip install -q -c constraints.txt -r requirements.txt -r requirements-cloud.txt; .venv/bin/pip install -q -c constraints.txt \"jax[tpu]==$jax_version\"; .venv/bin/pip install -q --no-deps -e .; .venv/bin/python -c \"import jax, flax, stare_jax; print(jax.__version__)\""
}

do_run() {
  train_args "$CONFIG" "$RUN_DIR" "$RESUME"
  local train
  train="$(cmdline .venv/bin/stare-jax "${TRAIN_ARGS[@]}")"
  ssh_all "cd $RDIR && mkdir -p logs && rm -f logs/train.exit && ( nohup $train > logs/train-\$(hostname).log 2>&1 & echo \$! > logs/train.pid; wait \$!; echo \$? > logs/train.exit ) < /dev/null > /dev/null 2>&1 &"
}

do_logs() {
  local follow=(-n "$LINES")
  [[ $FOLLOW == 0 ]] || follow+=(-F)
  ssh_one "$WORKER" "tail ${follow[*]} $RDIR/logs/train-\$(hostname).log"
}

do_stop() {
  if [[ $STOP_VM == 1 ]]; then
    run "${GC[@]}" tpu-vm stop "$NAME" "${LOC[@]}"
  else
    ssh_all "cd $RDIR && if [ -f logs/train.pid ]; then kill -TERM \"\$(cat logs/train.pid)\" 2>/dev/null || true; fi"
  fi
}

# The state of the slice, and what the watcher makes of it.
STATUS_CMD="cd $RDIR 2>/dev/null && if [ -f logs/train.exit ]; then echo \"exit \$(cat logs/train.exit)\"; elif [ -f logs/train.pid ] && kill -0 \"\$(cat logs/train.pid)\" 2>/dev/null; then echo running; else echo none; fi"

state_cmd() {
  if [[ $QUEUED == 1 ]]; then
    STATE=("${GC[@]}" queued-resources describe "$QR" "${LOC[@]}" --format='value(state.state)')
  else
    STATE=("${GC[@]}" tpu-vm describe "$NAME" "${LOC[@]}" --format='value(state)')
  fi
}

# classify STATE -> healthy | pending | lost | missing | stopped
classify() {
  case "$1" in
    "") echo missing ;;
    READY | ACTIVE) echo healthy ;;
    PREEMPTED | TERMINATED | SUSPENDING | SUSPENDED | FAILED) echo lost ;;
    STOPPING | STOPPED) echo stopped ;;
    *) echo pending ;; # CREATING, STARTING, RESTARTING, REPAIRING, ACCEPTED, PROVISIONING, WAITING_FOR_RESOURCES...
  esac
}

do_watch() {
  state_cmd
  if [[ "$DRY_RUN" == 1 ]]; then
    # One iteration: look at the slice and at worker 0's training, then the recovery path.
    run "${STATE[@]}"
    ssh_one 0 "$STATUS_CMD"
    do_delete
    do_create
    do_sync
    do_setup
    do_run
    run sleep "$INTERVAL"
    return 0
  fi
  local recoveries=0 bootstrap=0 state kind status
  while true; do
    capture state "${STATE[@]}"
    kind="$(classify "$state")"
    info "$(date -u +%H:%M:%S) slice ${NAME}: ${state:-not found} ($kind)"
    case "$kind" in
      healthy)
        if [[ $bootstrap == 1 ]]; then
          if do_sync && do_setup && do_run; then bootstrap=0; else warn "bootstrap failed; retrying next round"; fi
        else
          capture status "${GC[@]}" tpu-vm ssh "$NAME" "${LOC[@]}" --worker=0 --command "$STATUS_CMD"
          case "$status" in
            running) ;;
            "exit 0") info "training finished (worker 0 exit status 0)"; return 0 ;;
            exit*) die "training on worker 0 ended with '$status'; see 'launch/tpu_vm.sh logs --name $NAME --zone $ZONE'" ;;
            *) info "no training process on worker 0: starting it"; do_run || warn "run failed; retrying next round" ;;
          esac
        fi
        ;;
      lost | missing)
        ((recoveries < MAX_RECOVERIES)) || die "gave up after $recoveries re-creations (--max-recoveries)"
        recoveries=$((recoveries + 1))
        info "re-creating the slice (recovery $recoveries of at most $MAX_RECOVERIES)"
        if [[ "$kind" == lost ]]; then do_delete || warn "delete failed"; fi
        if do_create; then bootstrap=1; else warn "create failed; retrying next round"; fi
        ;;
      stopped) die "slice $NAME is $state (stopped by someone): start or delete it, then watch again" ;;
      pending) ;;
    esac
    sleep "$INTERVAL"
  done
}

case "$SUB" in
  create) do_create ;;
  setup) do_setup ;;
  sync) do_sync ;;
  run) do_run ;;
  logs) do_logs ;;
  watch) do_watch ;;
  stop) do_stop ;;
  delete) do_delete ;;
esac
