"""The evaluation framework: `specdec bench --quick` end to end on tiny models, and its pure parts."""

from __future__ import annotations

import itertools
import json
import subprocess

import pytest

from specdec.bench.analysis import cost_aware_speedup, percentile, seeds_speedup
from specdec.bench.dataset import DATASETS, load_prompts
from specdec.bench.quality import extract_code, passes_tests
from specdec.cli import main
from specdec.metrics import expected_length


def test_percentiles_and_predictions_by_hand():
    assert percentile([3.0, 1.0, 2.0, None], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)
    assert percentile([], 50) is None
    # seeds': α = 0.5, γ = 3, c = 0.1 → (1 − 0.5⁴) / (0.5 · 1.3)
    assert seeds_speedup(0.5, 3, 0.1) == pytest.approx((1 - 0.5**4) / 0.5 / 1.3)
    v = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4}
    # 10 tokens from 2 plain steps + 2 speculative steps of 3 drafts each: 2 + 2 · (v(4) + 3 · 0.1)
    assert cost_aware_speedup(10, 4, 2, 6, 0.1, v) == pytest.approx(10 / 5.2)
    # trees 1 deep with 4 nodes each: the forward is priced by its 4 + 1 rows, the drafting by the depth
    assert cost_aware_speedup(10, 4, 2, 2, 0.1, v, verified=8) == pytest.approx(10 / (2 + 2 * (1.4 + 0.1)))
    # every step drafting γ: the formula E[L] / (γc + v(γ+1))
    mean_length = expected_length(0.7, 3)
    assert cost_aware_speedup(round(100 * mean_length), 100, 100, 300, 0.05, v) == pytest.approx(
        round(100 * mean_length) / 100 / (3 * 0.05 + 1.3))


def test_quality_check_runs_the_tests():
    answer = "Here it is:\n```python\ndef double(x):\n    return 2 * x\n```\nDone."
    assert extract_code(answer).strip() == "def double(x):\n    return 2 * x"
    assert passes_tests(answer, "assert double(3) == 6")
    assert not passes_tests(answer, "assert double(3) == 7")
    assert not passes_tests("```python\nwhile True:\n    pass\n```", "", timeout_s=1.0)
    tasks = load_prompts("code_tests")
    assert len(tasks) >= 8 and all(t["tests"] for t in tasks)


def test_datasets_shipped_and_user_files(tmp_path):
    for name in DATASETS:
        assert len(load_prompts(name)) >= 8
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"id": "b", "kind": "completion", "prompt": "def f():"}\n')
    assert load_prompts(str(path)) == [{"id": "1", "kind": "chat", "prompt": "hello"},
                                      {"id": "b", "kind": "completion", "prompt": "def f():"}]
    path.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match="line 1: needs a non-empty string 'prompt'"):
        load_prompts(str(path))
    with pytest.raises(ValueError, match="no bench dataset 'nope'"):
        load_prompts("nope")


def test_quick_sweep_end_to_end_and_resume(tmp_path, monkeypatch, capsys):
    out, doc = tmp_path / "sweep", tmp_path / "BENCH.md"
    doc.write_text("# Benchmarks\n\n<!-- bench:other -->\nkept\n<!-- /bench:other -->\n")
    argv = ["bench", "--quick", "--datasets", "code", "edit", "--quality", "--quality-max-tokens", "16",
            "--seeds", "2", "--out", str(out), "--update", str(doc)]
    assert main(argv) == 0
    results = json.loads((out / "sweep.json").read_text())
    labels = {r["row"]["label"] for r in results}
    methods = ["draft_model (tiny-draft)", "ngram", "suffix"]
    assert labels == {"specdec none", *(f"specdec {m} {s}" for m in methods for s in ("γ=2", "adaptive γ≤2", "heuristic γ≤2")),
                      "transformers plain", "transformers assisted (its defaults)", "transformers prompt lookup (10)"}
    # specdec setups × (datasets × temperatures + the quality set) + peers × (datasets at temperature 0 + quality)
    assert len(results) == 10 * (2 * 2 + 1) + 3 * (2 + 1)
    plain = {(r["row"]["dataset"], r["row"]["temperature"]): r for r in results if r["row"]["label"] == "specdec none"}
    for r in results:
        row, cell = r["row"], r["cell"]
        base = plain[(row["dataset"], row["temperature"])]
        if row["label"] == "specdec none":
            assert row["speedup"] == 1.0
        if row["engine"] == "specdec" and row["dataset"] != "code_tests":  # 2 prompts, 2 seeds each where sampled
            requests = cell["passes"][-1]["requests"]
            assert len(requests) == (4 if row["temperature"] > 0 else 2)
            assert len({tuple(q["tokens"]) for q in requests}) == len(requests)
        if row["engine"] == "specdec" and row["temperature"] == 0:  # greedy: every method gives plain's tokens
            assert [q["tokens"] for q in cell["passes"][-1]["requests"]] == \
                   [q["tokens"] for q in base["cell"]["passes"][-1]["requests"]]
        if row["mean_accepted_length"] is not None:
            accepted = sum(q["speculative"]["num_accepted_tokens"] for q in cell["passes"][-1]["requests"])
            steps = sum(q["speculative"]["num_spec_steps"] for q in cell["passes"][-1]["requests"])
            assert row["mean_accepted_length"] == pytest.approx(1 + accepted / steps)
            assert 0 <= row["alpha"] <= 1 and len(row["per_position"]) <= 2
            assert row["predicted_cost_aware"] > 0 and row["efficiency"] > 0
        if row["schedule"]:  # every step counted once, priced by the cell's cost curves
            requests = [q["speculative"] for p in cell["passes"] for q in p["requests"]]
            steps = [sum(col) for col in itertools.zip_longest(*[q["gamma_histogram"] for q in requests], fillvalue=0)]
            tokens = sum(len(q["tokens"]) for p in cell["passes"] for q in p["requests"])
            assert sum(steps) == tokens - sum(q["num_accepted_tokens"] for q in requests)  # one bonus token per step
            cost = cell["cost"]
            units = sum(n * cost["v"][str(g + 1)] for g, n in enumerate(steps))
            forwards = sum(q["num_draft_forwards"] for q in requests)
            extra = sum(q["num_draft_tokens_fed"] for q in requests) - forwards
            assert (extra > 0) == (forwards > 0)  # a draft model that ran prefilled its prompt in one forward
            units += (forwards * cost.get("draft_ms_k1", 0) + extra * cost.get("draft_ms_per_extra_token", 0)) / cost["target_ms_k1"]
            assert row["modeled_speedup"] == pytest.approx(tokens / units)
            assert len(steps) <= 3  # γ ≤ 2
        if row["dataset"] == "code_tests":
            assert row["tests_passed"] is not None  # random tiny models: the rate itself is meaningless
        assert row["ttft_s"]["p50"] <= row["ttft_s"]["p99"]
    # a draft model's cells price both models by curves measured together, whichever cell measured them first
    priced: dict[tuple, set] = {}
    for r in results:
        if r["row"]["method"] == "draft_model":
            cost = r["cell"]["cost"]
            priced.setdefault((r["row"]["dataset"], r["row"]["temperature"]), set()).add(
                (cost["target_ms_k1"], cost["draft_ms_k1"]))
    assert priced and all(len(pricings) == 1 for pricings in priced.values())
    for name in ("alpha_vs_gamma", "speedup_vs_gamma", "per_position_acceptance", "time_split"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = doc.read_text()
    assert "kept" in text and "<!-- bench:sweep -->" in text and "### Speedup over plain decoding, temperature 1" in text
    assert "### γ schedules" in text
    assert (out / "report.md").read_text().startswith("## Sweep")

    def no_workers(*args, **kwargs):
        raise AssertionError("a cached cell ran again")

    monkeypatch.setattr(subprocess, "Popen", no_workers)
    capsys.readouterr()
    assert main(argv) == 0  # every cell cached: the report is rebuilt without running anything
    assert json.loads((out / "sweep.json").read_text())[0]["cell"] == results[0]["cell"]
