"""``benchmarks/trainer_engine.py --smoke`` runs end to end (seconds) and reports every
figure it promises: throughput of both trainers, saved-for-backward memory of every option
combination, the longest-trajectory probe, export rates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_trainer_engine_benchmark_smoke(tmp_path):
    out = tmp_path / "figures.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    script = ROOT / "benchmarks" / "trainer_engine.py"
    run = subprocess.run(
        [sys.executable, str(script), "--smoke", "--cpu", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("plain_tok_s", "engine_tok_s", "engine+ckpt_tok_s"):
        assert res[key] > 0, key
    for key in ("export_new_gbps", "export_old_gbps", "copy_baseline_gbps"):
        assert res[key] > 0, key
    saved = {k: v for k, v in res.items() if k.startswith("saved_mb_")}
    assert len(saved) == 5 and all(v > 0 for v in saved.values())
    # checkpointing and the chunked head each cut what a forward keeps for backward
    assert saved["saved_mb_ckpt_chunk"] < saved["saved_mb_ckpt_full"]
    assert saved["saved_mb_ckpt_chunk"] < saved["saved_mb_nockpt_chunk"]
    assert res["engine_longest"] >= 32 and "cap" in res["engine_longest_why"]
    assert "plain torch loop" in run.stdout and "GB/s" in run.stdout


def test_trainer_engine_goals_smoke(tmp_path):
    """``--goals`` (issue 37's rows): every row trains and reports its per-step counts from
    the profiler, the engine's on its own worker thread too; the long trajectory trains with
    activation offload."""
    out = tmp_path / "goals.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    script = ROOT / "benchmarks" / "trainer_engine.py"
    args = ["--goals", "--smoke", "--cpu", "--rows", "plain,default", "--steps", "1"]
    run = subprocess.run(
        [sys.executable, str(script), *args, "--longest", "64", "--longest-offload-only",
         "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    for row in ("plain", "default"):
        assert res[f"{row}_tok_s"] > 0, row
        assert res[f"{row}_aten_ops"] > 100, row  # counted, not an empty profile
        assert res[f"{row}_launches"] == res[f"{row}_syncs"] == 0  # none exist on CPU
    assert res["longest_new+ckpt+offload"]["tokens"] == 64
    assert "launches" in run.stdout and "syncs" in run.stdout
