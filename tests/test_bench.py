"""Benchmarks on tiny models: they run, their files appear, and their numbers hang together."""

from __future__ import annotations

import json

import pytest

from conftest import build_tiny_model
from specdec.bench import run_benchmark
from specdec.bench.draft_model import predicted_speedups
from specdec.bench.report import same_greedy_tokens, update_section
from specdec.models.cost_curve import DEFAULT_KS


def test_predicted_speedups_by_hand():
    seeds, aware = predicted_speedups(alpha=0.5, mean_length=1.875, gamma=3, c=0.25, v=1.5)
    assert seeds == pytest.approx(1.875 / 1.75)  # (1 − 0.5⁴)/(0.5 · (3·0.25 + 1))
    assert aware == pytest.approx(1.875 / 2.25)  # E[L] / (γc + v)


def test_update_section_replaces_only_its_own_block(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text("# Benchmarks\n\nhand-written notes\n")
    update_section(doc, "x", "first")
    update_section(doc, "y", "other")
    update_section(doc, "x", "second")
    text = doc.read_text()
    assert "hand-written notes" in text and "other" in text and "second" in text and "first" not in text


def test_same_greedy_tokens_compares_up_to_eos():
    assert same_greedy_tokens([[1, 2, 9, 5], [1, 2]], [[1, 2, 9, 7], [1, 3]], {9}) == "1/2"
    assert same_greedy_tokens([[1, 9, 4]], [[1, 5, 6]], {9}) == "1/1"  # the other run suppressed EOS
    assert same_greedy_tokens([[1, 9, 4]], [[2, 5, 6]], {9}) == "0/1"


def test_draft_model_bench_on_tiny_models(tiny_qwen, tiny_qwen_draft, tmp_path, capsys):
    out, doc = tmp_path / "results", tmp_path / "BENCH.md"
    code = run_benchmark("draft_model", [
        "--target", str(tiny_qwen), "--draft", str(tiny_qwen_draft), "--gammas", "1", "3", "--no-transformers",
        "--target-formats", "fp32", "int8", "--draft-formats", "int8",
        "--repeat", "2", "--num-prompts", "2", "--max-tokens", "12", "--out", str(out), "--update", str(doc)])
    assert code == 0
    results = json.loads((out / "draft_model.json").read_text())
    assert [r["label"] for r in results] == [
        "specdec plain", "specdec draft_model γ=1 [fp32 + int8 draft]", "specdec draft_model γ=3 [fp32 + int8 draft]",
        "specdec plain [int8]", "specdec draft_model γ=1 [int8 + int8 draft]", "specdec draft_model γ=3 [int8 + int8 draft]",
    ]
    for r in results:
        assert len(r["tok_per_s"]) == 2 and all(t > 0 for t in r["tok_per_s"])
    for plain, spec_rows in ((results[0], results[1:3]), (results[3], results[4:])):
        for r in spec_rows:
            assert r["tokens"] == plain["tokens"]  # greedy identity inside the bench too, per target format
            s = r["speculative"]
            assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_spec_steps"])
    for r in (results[1], results[4]):
        assert set(r["costs"]["target_ms"]) == {"1", "2", "3", "4", "5", "7", "9"} and r["costs"]["draft_ms"]["1"] > 0
    table = doc.read_text()
    assert "<!-- bench:draft_model -->" in table and "| specdec draft_model γ=3 [int8 + int8 draft] |" in table
    assert "c = " in table and "- int8 target + int8 draft: best γ=" in table


def test_cost_curve_bench_on_a_tiny_model(tiny_qwen, tmp_path):
    out, doc = tmp_path / "results", tmp_path / "BENCH.md"
    code = run_benchmark("cost_curve", ["--models", str(tiny_qwen), "--no-transformers", "--repeat", "1",
                                        "--num-prompts", "2", "--max-tokens", "6", "--out", str(out), "--update", str(doc)])
    assert code == 0
    fp32, int8 = json.loads((out / "cost_curve.json").read_text())
    for r in (fp32, int8):
        assert set(r["curve"]["ms"]) == {"128", "1024"}
        assert set(r["curve"]["ms"]["128"]) == {str(k) for k in DEFAULT_KS}
        assert all(0 < r["roofline_ms"][c][k] for c in r["roofline_ms"] for k in r["roofline_ms"][c])
        c = r["ceilings"]
        assert c["read_bytes_per_s"] == max(c["readers"].values()) and c["fp32_macs_per_s"] > 0
        # ceilings taken after each of the 5 rounds, each round's times against them
        rounds = r["ceilings_by_round"]
        assert len(rounds) == 5 and all(c["read_bytes_per_s"] >= x["read_bytes_per_s"] for x in rounds)
        assert all(len(r["curve"]["samples"][ctx][k]) == 5 for ctx in ("128", "1024") for k in r["curve"]["ms"]["128"])
        # and each forward against the bandwidth probed right after it
        assert all(len(r["probed_bytes_per_s"][ctx][k]) == 5 for ctx in ("128", "1024") for k in r["curve"]["ms"]["128"])
        assert all(r["paired_ratio"][ctx][k] > 0 for ctx in ("128", "1024") for k in r["curve"]["ms"]["128"])
        assert r["prefill"]["prompt_tokens"] == 511 and r["nll"] > 0  # the held text, cut to the tiny context
        assert r["decode_roofline_after_ms"] > 0  # plain decoding against the ceilings taken right after it
        # and each request against the bandwidths probed right before and after it: one probe per timed request + 1
        assert len(r["decode_paired_shares"]) == len(r["request_probes_bytes_per_s"]) - 1 == 2
        assert all(share > 0 for share in r["decode_paired_shares"])
        assert len(r["decode_step_paired_shares"]) == 2 and all(share > 0 for share in r["decode_step_paired_shares"])
        # and each decode step of one more pass against the bandwidth probed right after it: 5 steps after each
        # prompt's first token, the cache growing by one a step
        steps = r["decode_steps_probed"]
        assert len(steps) == len(r["decode_step_probe_shares"]) == 2 * 5
        assert [cached for _, cached, _ in steps[1:5]] == [steps[0][1] + i for i in range(1, 5)]
        assert all(ms > 0 and bandwidth > 0 for ms, _, bandwidth in steps)
        assert all(share > 0 for share in r["decode_step_probe_shares"])
    assert int8["work"]["int8"] and int8["work"]["weight_bytes"] < fp32["work"]["weight_bytes"] / 3
    assert (out / "cost_curve.png").stat().st_size > 10_000
    table = doc.read_text()
    assert "<!-- bench:cost_curve -->" in table and "<!-- bench:formats -->" in table
    assert "| int8 | 1024 |" in table


def test_plain_decode_bench_on_a_tiny_model(tiny_qwen, tmp_path):
    out = tmp_path / "results"
    code = run_benchmark("plain_decode", ["--models", str(tiny_qwen), "--repeat", "1", "--num-prompts", "2",
                                          "--max-tokens", "6", "--out", str(out)])
    assert code == 0
    results = json.loads((out / "plain_decode.json").read_text())
    assert [r["spec"]["engine"] for r in results] == ["specdec", "transformers"]
    assert results[0]["tokens"] == results[1]["tokens"]  # same greedy tokens as transformers


def test_ngram_bench_on_a_tiny_model(tmp_path):
    out, doc = tmp_path / "results", tmp_path / "BENCH.md"
    model = build_tiny_model(tmp_path / "model", max_position_embeddings=2048)  # the edit prompts: ~1k bytes
    code = run_benchmark("ngram", [
        "--model", str(model), "--datasets", "edit", "code", "--gammas", "4", "--ngram-sizes", "1-3",
        "--suffix-gammas", "6", "--repeat", "1", "--num-prompts", "2", "--max-tokens", "16", "--edit-max-tokens", "24",
        "--out", str(out), "--update", str(doc)])
    assert code == 0
    results = json.loads((out / "ngram.json").read_text())
    labels = ["specdec plain [int8]", "specdec ngram γ=4, prompt_lookup_min=1, prompt_lookup_max=3 [int8]",
              "specdec suffix γ=6 [int8]", "transformers plain", "transformers prompt lookup (10 tokens)"]
    assert [r["label"] for r in results] == labels * 2
    for dataset in range(2):
        plain, *spec, hf_plain, hf_lookup = results[5 * dataset : 5 * dataset + 5]
        for r in spec:
            assert r["tokens"] == plain["tokens"]  # greedy identity inside the bench
            assert r["speculative"]["num_spec_steps"] > 0
        assert hf_lookup["tokens"] == hf_plain["tokens"]
    assert all(len(t) == 16 for t in results[5]["tokens"])  # `code` ignores EOS; `edit` stops at it
    table = doc.read_text()
    assert "<!-- bench:ngram -->" in table and "### `edit`" in table and "### `code`" in table


def test_cuda_bench_runs_on_the_cpu_with_tiny_configs(tiny_qwen, tiny_qwen_draft, tmp_path):
    """The GPU bench's own code, where CI can run it: on the CPU, float32 rows are exact, so the target as its
    own draft has every draft accepted and every output equal to plain decoding."""
    out = tmp_path / "cuda.json"
    ks = ["1", "2", "4", "70"]
    assert run_benchmark("cuda", ["--device", "cpu", "--dtype", "float32", "--target-config", str(tiny_qwen / "config.json"),
                                  "--draft-config", str(tiny_qwen_draft / "config.json"), "--ks", *ks, "--max-tokens", "24",
                                  "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ceilings"]["read_bytes_per_s"] > 0 and result["ceilings"]["fp32_macs_per_s"] > 0
    for curves in result["curves"].values():
        for row in curves.values():
            assert sorted(row, key=int) == ks and all(v["ms"] > 0 and v["roofline_ms"] > 0 for v in row.values())
    assert result["decode"]["draft = target"]["acceptance"] == 1.0
    assert {run["identical_to_plain"] for run in result["decode"].values()} == {"3/3"}


def test_unknown_benchmark():
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        run_benchmark("nope", [])


def test_serve_load_bench_on_tiny_models(tiny_qwen, tiny_qwen_draft, tmp_path):
    """Real `specdec serve` subprocesses under concurrent streamed clients: every request gets its tokens, the
    table compares modes at each concurrency, and speculation counters come from the server's /metrics."""
    out, doc = tmp_path / "results", tmp_path / "BENCH.md"
    code = run_benchmark("serve_load", [
        "--model", str(tiny_qwen), "--draft", str(tiny_qwen_draft), "--modes", "off", "fixed", "--gamma", "3",
        "--concurrency", "1", "3", "--requests-per-client", "2", "--max-tokens", "6", "--datasets", "chat",
        "--out", str(out), "--update", str(doc)])
    assert code == 0
    results = json.loads((out / "serve_load.json").read_text())
    assert [(r["mode"], r["concurrency"]) for r in results] == [("off", 1), ("off", 3), ("fixed", 1), ("fixed", 3)]
    for r in results:
        assert len(r["requests"]) == 2 * r["concurrency"] and all(q["tokens"] == 6 for q in r["requests"])
        assert r["tok_per_s"] > 0 and r["ttft_s"]["p50"] <= r["ttft_s"]["p99"]
        assert (r["draft_tokens"] > 0) == (r["mode"] == "fixed")
        assert 0 <= r["accepted_tokens"] <= r["draft_tokens"]
    assert "| fixed | 3 |" in doc.read_text()
