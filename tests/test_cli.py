"""The command line: streamed and JSON generation, model listing, clear errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec import LLM, SamplingParams
from specdec.cli import main


def test_generate_json_matches_the_api(tiny_qwen, capsys):
    code = main(["generate", "def f(x):", "--model", str(tiny_qwen), "--max-tokens", "6", "--json", "--max-model-len", "64"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    [expected] = LLM(str(tiny_qwen), max_model_len=64).generate("def f(x):", SamplingParams(temperature=0, max_tokens=6))
    assert result["token_ids"] == expected.outputs[0].token_ids
    assert result["text"] == expected.outputs[0].text
    assert result["finish_reason"] == "length"
    assert result["metrics"]["num_output_tokens"] == 6 and result["metrics"]["ttft_s"] > 0


def test_generate_streams_text_and_reports_on_stderr(tiny_qwen, capsys):
    code = main(["generate", "hello", "--model", str(tiny_qwen), "--max-tokens", "5", "--chat"])
    out, err = capsys.readouterr()
    assert code == 0
    llm = LLM(str(tiny_qwen))
    [expected] = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=5))
    assert out == expected.outputs[0].text + "\n"
    assert "5 tokens" in err and "finish: length" in err


def test_bad_input_exits_2_with_a_message(tiny_qwen, capsys):
    assert main(["generate", "x", "--model", str(tiny_qwen), "--temperature", "-1"]) == 2
    assert "error: temperature must be >= 0" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "no/such-model"]) == 2
    assert "unknown model 'no/such-model'" in capsys.readouterr().err
    assert main(["generate", "", "--model", str(tiny_qwen)]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["generate", "x" * 100, "--model", str(tiny_qwen), "--max-model-len", "50"]) == 2
    assert "max_model_len=50" in capsys.readouterr().err


def test_models_list_entry_point():
    done = subprocess.run([sys.executable, "-m", "specdec.cli", "models", "list", "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    assert set(rows) == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}
    assert rows["qwen2.5-coder-1.5b"]["converted"] is False  # the tests' cache is empty


def test_generate_with_a_draft_model_prints_speculation_metrics(tiny_qwen, tiny_qwen_draft, capsys):
    args = ["generate", "def f(x):", "--model", str(tiny_qwen), "--max-tokens", "10", "--max-model-len", "64"]
    assert main(args + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["metrics"]["speculative_decoding"] is None
    spec_args = args + ["--method", "draft_model", "--draft", str(tiny_qwen_draft), "--num-speculative-tokens", "3", "--no-adaptive"]
    assert main(spec_args + ["--json"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]  # greedy: identical output
    sd = spec["metrics"]["speculative_decoding"]
    assert sd["num_spec_steps"] > 0 and set(sd) >= {"draft_acceptance_rate", "mean_acceptance_length", "alpha",
                                                     "acceptance_histogram", "draft_time_s", "verify_time_s"}
    assert main(spec_args) == 0
    assert "mean accepted length" in capsys.readouterr().err
    assert main(args + ["--method", "eagle9"]) == 2
    assert "unknown speculative method 'eagle9'" in capsys.readouterr().err


@pytest.mark.parametrize("method", [["--method", "ngram", "--prompt-lookup-min", "1", "--prompt-lookup-max", "3"],
                                    ["--method", "suffix"]], ids=["ngram", "suffix"])
def test_generate_with_a_context_proposer(method, tiny_qwen, capsys):
    args = ["generate", "ab ab ab ab", "--model", str(tiny_qwen), "--max-tokens", "24", "--max-model-len", "64", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + method) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["metrics"]["speculative_decoding"]["num_spec_steps"] > 0


def test_generate_with_int8_weights_for_target_and_draft(tiny_qwen, tiny_qwen_draft, capsys):
    args = ["generate", "def f(x):", "--model", str(tiny_qwen), "--max-tokens", "10", "--max-model-len", "64",
            "--quantization", "int8", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--method", "draft_model", "--draft", str(tiny_qwen_draft), "--draft-quantization", "int8"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    with pytest.raises(SystemExit):
        main(args + ["--quantization", "int3"])


@pytest.mark.parametrize("argv, message", [
    (["serve", "--speculative-config", "{not json"], "--speculative-config is not valid JSON, auto or none"),
    (["serve", "no-such-model"], "unknown model 'no-such-model'"),
    (["serve", "--speculative-config", '{"method": "draft_model"}'], "num_speculative_tokens"),
])
def test_serve_refuses_bad_arguments_before_listening(argv, message, tiny_qwen, capsys):
    if argv[1] != "no-such-model":
        argv.insert(1, str(tiny_qwen))
    assert main(argv) == 2
    assert message in capsys.readouterr().err
