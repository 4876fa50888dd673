# shellcheck shell=bash
# Shared helpers for the launch/ scripts (source it; it is not meant to be run):
#   errors and warnings, argument checks, and the dry-run aware `run`, `run_tee`, `capture`, `write_file`.
#
# Contract of every launch script:
#   * all arguments are validated before anything is created or run; a bad argument is one line on stderr
#     ("<script>: error: ...") and exit status 2, with nothing printed on stdout;
#   * with --dry-run the commands are printed on stdout, one shell command per line, quoted so that the line can
#     be pasted into bash as is, instead of being run. Messages for people always go to stderr.

DRY_RUN=0
PROG="$(basename "$0")"
# The checkout these scripts belong to (launch/..).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() {
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  exit 2
}

warn() { printf '%s: warning: %s\n' "$PROG" "$*" >&2; }

info() { printf '%s: %s\n' "$PROG" "$*" >&2; }

# shq WORD: WORD quoted for bash; plain words (letters, digits and _ . / : = @ % + , ^ -) stay unquoted.
shq() {
  local s="$1"
  if [[ -n "$s" && "$s" =~ ^[A-Za-z0-9_./:=@%+,^-]+$ ]]; then
    printf '%s' "$s"
  else
    local q="'\\''"
    printf "'%s'" "${s//\'/$q}"
  fi
}

# cmdline ARGS...: the argument vector as one line of bash.
cmdline() {
  local out="" a
  for a in "$@"; do
    out+="${out:+ }$(shq "$a")"
  done
  printf '%s\n' "$out"
}

# run CMD ARGS...: print the command (dry run) or run it.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    cmdline "$@"
  else
    "$@"
  fi
}

# run_tee LOGFILE CMD ARGS...: run CMD with stdout+stderr shown and appended to LOGFILE; keeps CMD's exit status.
run_tee() {
  local log="$1"
  shift
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%s 2>&1 | tee -a %s\n' "$(cmdline "$@")" "$(shq "$log")"
  else
    "$@" 2>&1 | tee -a "$log"
    return "${PIPESTATUS[0]}"
  fi
}

# capture VAR CMD ARGS...: VAR := CMD's stdout (stderr dropped; a failing CMD gives ""). Dry run: print, VAR := "".
capture() {
  local __var="$1"
  shift
  if [[ "$DRY_RUN" == 1 ]]; then
    cmdline "$@"
    printf -v "$__var" '%s' ""
  else
    local __out
    __out="$("$@" 2>/dev/null)" || __out=""
    printf -v "$__var" '%s' "$__out"
  fi
}

# write_file PATH CONTENT: write CONTENT to PATH (dry run: print the here-document that would write it).
write_file() {
  local path="$1" content="$2"
  if [[ "$DRY_RUN" == 1 ]]; then
    printf 'cat > %s <<'\''EOF_STARE_JAX'\''\n%s\nEOF_STARE_JAX\n' "$(shq "$path")" "$content"
  else
    printf '%s\n' "$content" >"$path"
  fi
}

# need_value OPTION "$@": OPTION must be followed by a value (not another --option).
need_value() {
  local opt="$1"
  shift
  if [[ $# -lt 1 || -z "$1" || "$1" == --* ]]; then
    die "option $opt needs a value"
  fi
}

# split_eq ARGS...: prints NUL-separated args with --opt=value split into --opt value (for `mapfile -d ''`).
split_eq() {
  local a
  for a in "$@"; do
    if [[ "$a" == --*=* ]]; then
      printf '%s\0%s\0' "${a%%=*}" "${a#*=}"
    else
      printf '%s\0' "$a"
    fi
  done
}

# check_pos_int NAME VALUE: VALUE is a positive integer (no sign, no leading zero).
check_pos_int() {
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer, got '$2'"
}

# check_word NAME VALUE: VALUE is safe to embed in a remote shell command (no spaces, quotes, $, ;, &, |, ...).
check_word() {
  [[ -n "$2" ]] || die "$1 must not be empty"
  [[ "$2" =~ ^[A-Za-z0-9_./:=@%+,~-]+$ ]] \
    || die "$1 '$2' has characters that are not accepted (allowed: letters, digits and _ . / : = @ % + , ~ -)"
}

# check_host_port NAME VALUE: VALUE is HOST:PORT (HOST a name, IPv4 or [IPv6]), PORT in 1..65535.
check_host_port() {
  local v="$2"
  [[ "$v" =~ ^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]+)$ ]] \
    || die "$1 must be HOST:PORT (e.g. node0:8476), got '$v'"
  local port="${BASH_REMATCH[2]}"
  ((10#$port >= 1 && 10#$port <= 65535)) || die "$1 port must be in 1..65535, got '$port' in '$v'"
}

# seq_csv N: "0,1,...,N-1".
seq_csv() {
  local n="$1" i out=""
  for ((i = 0; i < n; i++)); do
    out+="${out:+,}$i"
  done
  printf '%s' "$out"
}

# train_args CONFIG RUN_DIR RESUME(0|1): the `stare-jax train` arguments shared by every launcher.
#   CLI contract assumed (see README of launch/): stare-jax train --config CFG --run-dir DIR [--resume
#   [--allow-config-change]] [--coordinator-address HOST:PORT --num-processes N --process-id I]
#   --resume means: continue from the latest checkpoint in --run-dir if there is one, else start fresh.
#   --allow-config-change (ALLOW_CONFIG_CHANGE=1, the launchers' --allow-config-change): a resumed run may change
#   settings beyond the operational ones; every change is recorded in RUN_DIR/config_changes.jsonl.
ALLOW_CONFIG_CHANGE=0
train_args() {
  TRAIN_ARGS=(train --config "$1" --run-dir "$2")
  if [[ "$3" == 1 ]]; then
    TRAIN_ARGS+=(--resume)
    if [[ "$ALLOW_CONFIG_CHANGE" == 1 ]]; then
      TRAIN_ARGS+=(--allow-config-change)
    fi
  elif [[ "$ALLOW_CONFIG_CHANGE" == 1 ]]; then
    die "--allow-config-change only applies when resuming: drop --no-resume, or drop --allow-config-change"
  fi
  TRAIN_ARGS+=(${OVERRIDES[@]+"${OVERRIDES[@]}"})
}

# add_override KEY=VALUE: a config override (--set) passed on to `stare-jax train` and to the layout check.
OVERRIDES=()
add_override() {
  [[ "$1" =~ ^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=.+$ ]] \
    || die "--set must be KEY=VALUE with a dotted config key (e.g. model.path=/data/Qwen2.5-Math-7B), got '$1'"
  check_word --set "$1"
  OVERRIDES+=("$1")
}

# check_config PATH: the config file exists in this checkout (relative paths are relative to the checkout).
check_config() {
  local c="$1"
  [[ -n "$c" ]] || die "--config is required (e.g. configs/paper/qwen2.5-math-7b_stare_c2.yaml)"
  local p="$c"
  [[ "$c" == /* ]] || p="$ROOT/$c"
  [[ -f "$p" ]] || die "config file not found: $c (looked for $p)"
}

# check_gpu_type TYPE: a GPU model `stare-jax plan` knows (its HBM and peak FLOP/s).
GPU_TYPES="A100 H100 H200 B200"
check_gpu_type() {
  [[ " $GPU_TYPES " == *" $1 "* ]] || die "--gpu-type must be one of: $GPU_TYPES, got '$1'"
}

# check_layout CFG [ACCELERATOR]: the config checked against the accelerator on THIS machine, before anything is
# created or started: the mesh must divide the device count, the batch must split over the data shards, prompt +
# response must fit the model's context (`stare-jax plan`, which also knows every accelerator name). Without
# ACCELERATOR the config's launch.accelerator is used. Needs this checkout's .venv (bash launch/local_setup.sh);
# STARE_JAX_SKIP_LAYOUT_CHECK=1 skips it (e.g. launching from a machine without Python 3.11).
check_layout() {
  local c="$1" accel="${2:-}" py="${STARE_JAX_PYTHON:-$ROOT/.venv/bin/python}" err
  [[ "${STARE_JAX_SKIP_LAYOUT_CHECK:-0}" == 1 ]] && return 0
  [[ -x "$py" ]] || die "checking $c needs this checkout's environment: run 'bash launch/local_setup.sh' first (or set STARE_JAX_SKIP_LAYOUT_CHECK=1)"
  local args=(-m stare_jax.cli plan "$c" ${OVERRIDES[@]+"${OVERRIDES[@]}"} --json)
  [[ -n "$accel" ]] && args+=(--accelerator "$accel")
  if ! err="$(cd "$ROOT" && "$py" "${args[@]}" 2>&1 >/dev/null)"; then
    err="$(printf '%s\n' "$err" | grep -v '^[[:space:]]*$' | tail -n 1)"
    die "config $c on ${accel:-its launch.accelerator}: ${err#stare-jax plan: }"
  fi
}
