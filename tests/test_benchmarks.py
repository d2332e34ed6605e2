"""The benchmark scripts run end to end (their figures are for README; here only that they work)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_quick_writes_every_section(tmp_path):
    """The one-shot GPU check, in its quick form on this machine: every section runs, lands in the report with its
    verdict, and none fails (the CUDA-only ones are skipped)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(tmp_path), "--quick",
           "--compile-backend", "aot_eager"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    report = (tmp_path / "gpu_check.md").read_text()
    assert "FAILED" not in report, report
    verdicts = {"CUDA tests": "SKIPPED", "Exactness on CUDA": "SKIPPED", "Planning on the device": "PASS",
                "Escalation under a reduced memory fraction": "", "Memory table": "PASS",
                "AutoBatch with and without checkpointing": "PASS", "Compiled checkpointed step": "PASS"}
    for title, verdict in verdicts.items():
        assert f"## {title}: {verdict}" in report, title
        assert f"{title}: {verdict}" in out.stdout, title
    assert "| test_memory::test_cuda_helpers_reject_cpu_device | passed |" in report  # the pytest table is read
    assert "| auto | 4 | (" in report and "| batch=-1 all | 4 | ('all', 'full', None) |" in report
    assert "| yolo11n.yaml | 128 | 4 | off | all |" in report and "compiled [2,3] (aot_eager) | 1 | 0 |" in report
