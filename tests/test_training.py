"""Training Medusa heads on a tiny model: the loss falls within seconds, a second run resumes instead of
starting over, and the heads it writes drive speculation (greedy identity holds whatever their quality)."""

from __future__ import annotations

import json

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.models.medusa import MedusaHeads
from specdec.training.data import CorpusConfig
from specdec.training.medusa import MedusaTrainingConfig, train_medusa


def test_training_lowers_the_heads_loss_and_resumes(tiny_qwen, tmp_path):
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=1024)
    corpus = CorpusConfig(corpus_tokens=3000, generated_tokens=256, chunk_tokens=256)
    config = MedusaTrainingConfig(num_heads=2, vocab_size=64, epochs=3, batch_size=64, learning_rate=3e-3)
    report = train_medusa(llm, tmp_path / "heads", corpus, config)
    before, after = report["before"], report["after"]
    assert all(a < b for a, b in zip(after["loss"], before["loss"])), (before, after)
    assert report["epochs"][-1]["train_loss"] < report["epochs"][0]["train_loss"]
    heads = MedusaHeads.load(tmp_path / "heads")
    assert heads.config.num_heads == 2 and 0 < len(heads.vocab) <= 64  # (the corpus may hold fewer tokens)
    assert json.loads((tmp_path / "heads" / "training.json").read_text())["after"] == after

    shards = sorted((tmp_path / "heads" / "data").glob("shard_*.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    again = train_medusa(llm, tmp_path / "heads", corpus, config)  # every epoch is done: nothing to redo
    assert again["epochs"] == report["epochs"]
    assert [p.stat().st_mtime_ns for p in shards] == stamps

    plain = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    spec = LLM(str(tiny_qwen), quantization=None, speculative_config={"method": "medusa", "model": str(tmp_path / "heads")})
    out = spec.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_train_heads_command(tiny_qwen, tmp_path, capsys):
    code = main(["train-heads", "--method", "medusa", "--model", str(tiny_qwen), "--out", str(tmp_path / "h"),
                 "--num-heads", "2", "--vocab-size", "0", "--corpus-tokens", "600", "--generated-tokens", "0",
                 "--epochs", "1", "--quantization", "none"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["heads"] == str(tmp_path / "h") and len(printed["after"]["top1"]) == 2
    assert MedusaHeads.load(tmp_path / "h").vocab is None
    assert main(["train-heads", "--method", "medusa", "--model", str(tiny_qwen), "--epochs", "0"]) == 2
