"""`tierkv bench --device transformers --quick` runs end to end on the embedded default
hierarchy and reports each figure; the figures themselves are recorded in docs/benchmarks.md,
not asserted here, but the correctness of what it served is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierkv.cli import main

pytest.importorskip("transformers", reason="the transformers extra is not installed")

pytestmark = pytest.mark.pmem


def test_quick_bench_reports_ttft_reuse_and_tiers(tmp_path: Path) -> None:
    out_file = tmp_path / "bench.json"
    code = main(["bench", "--device", "transformers", "--quick", "--workdir", str(tmp_path),
                 "--json", str(out_file)])
    assert code == 0
    document = json.loads(out_file.read_text())
    result = document["results"]["transformers"]
    block = result["model"]["block_tokens"]
    for workload in ("conversation", "qa"):
        summary = result[workload]
        assert summary["cached_tokens"] > 0  # later turns loaded their history
        assert summary["max_logit_diff"] <= 1e-5 and summary["same_first_token"]
        # every cached token came from a block some tier served
        assert sum(summary["blocks_by_tier"].values()) * block == summary["cached_tokens"]
        assert summary["ttft_s_p50_ms"] > 0 and summary["recompute_s_p99_ms"] > 0
    cases = [row["case"] for row in document["rows"]]
    assert any(case.startswith("KV bytes per token: Llama 2 layers") for case in cases)
    assert "conversation: TTFT with / without tierkv (sum over requests)" in cases
    assert list(tmp_path.iterdir()) == [out_file]  # the hierarchy's scratch files are gone
