"""The cluster launchers in scripts/ (docs/runtime.md, Clusters).

The SLURM batch script runs here unchanged as a two-node job: stand-ins for ``srun`` (one task per node, both on
this machine, as SLURM starts them) and ``scontrol`` (the node list) come first on ``PATH``, the job's
``SLURM_*`` variables are set as SLURM sets them, and torchrun's c10d rendezvous joins the two "nodes" on
localhost (gloo, one process per node, a two-stage pipeline). A first attempt fails at step 3 after the
checkpoint of step 2 (a fault drill, ``distributed.faults``); the requeued job continues the run from it.
The Kubeflow manifest is checked for the fields the operator and torchrun read.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bubblefree.train.checkpoint import list_checkpoints
from bubblefree.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
PYTORCHJOB = ROOT / "scripts" / "kubernetes" / "pytorchjob.yaml"

FAKE_SRUN = """#!/bin/bash
# srun's stand-in: one task per node of the job, each with its SLURM_NODEID / SLURM_PROCID, all on this machine.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""

FAKE_SCONTROL = """#!/bin/bash
# scontrol's stand-in for `scontrol show hostnames LIST`: every node of the job is this machine.
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do echo localhost; done
"""


@pytest.fixture(autouse=True)
def _session_cache(data_cache):
    """The job's processes use the session's data cache (conftest.py)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp_path: Path, run: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    torchrun = Path(sys.executable).parent
    job_env = {**os.environ, "PATH": f"{bin_dir}:{torchrun}:{os.environ['PATH']}", "SLURM_JOB_NAME": "bubblefree",
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[0-1]",
               "NPROC_PER_NODE": "1", "MASTER_PORT": str(_free_port()), "RUN": str(run),
               "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(SBATCH), *args], env=job_env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=900, check=False)


@pytest.mark.slow
def test_slurm_script_trains_on_two_nodes_and_a_requeued_job_resumes(tmp_path):
    assert shutil.which("bash")
    run = tmp_path / "runs" / "job"
    sets = ["pipeline.runtime=distributed", "pipeline.stages=2", "pipeline.schedule=2bw", "pipeline.microbatches=2",
            "train.steps=4", "train.batch_size=4", "train.seq_len=32", "train.log_every=1", "train.ckpt_every=2",
            "train.eval_every=0", "train.eval_batches=1", "log.progress=false"]
    args = ["--preset", "smoke", *(a for s in sets for a in ("--set", s))]

    first = _job(tmp_path, run, args, BUBBLEFREE_FAULT="1:3:raise")  # node 1's rank fails starting step 4
    assert first.returncode != 0, first.stdout + first.stderr
    assert [step for step, _ in list_checkpoints(run)] == [2]
    assert "injected fault at step 3" in first.stdout + first.stderr

    second = _job(tmp_path, run, args)  # the requeue: same job id, same run folder, no fault
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming" in second.stdout and "step 2/4" in second.stdout
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # the failed attempt's step 3 record was replaced
    assert max(step for step, _ in list_checkpoints(run)) == 4
    assert all(len(r["stage_busy"]) == 2 for r in records)  # two stages, one per "node"


def test_pytorchjob_manifest_runs_torchrun_with_c10d_and_resumes():
    import yaml  # the test extra's
    job = yaml.safe_load(PYTORCHJOB.read_text())
    assert job["kind"] == "PyTorchJob" and job["apiVersion"] == "kubeflow.org/v1"
    assert job["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    script = worker["template"]["spec"]["containers"][0]["args"][0]
    assert "torchrun" in script and "-m bubblefree.distributed" in script and "--resume" in script
    # The same command line as the SLURM script's, which the test above runs.
    assert "--out \"$RUN\"" in script and "--out \"$RUN\"" in SBATCH.read_text()
