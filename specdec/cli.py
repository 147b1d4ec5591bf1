"""`specdec generate | serve | models | train-heads | bench`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from specdec.config import QUANTIZATION_METHODS
from specdec.models import zoo

DEFAULT_MAX_GAMMA = 8  # the adaptive controller drafts up to this many; most steps it picks fewer


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1].startswith("-") and argv[1] not in ("-h", "--help")):
        argv.insert(1, "sweep")  # `specdec bench [options]` is the sweep
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except ValueError as error:  # user errors: unknown model, bad params, prompt too long, ...
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative-decoding inference engine.")
    commands = parser.add_subparsers()

    gen = commands.add_parser("generate", help="generate a completion, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=zoo.DEFAULT_MODEL, help="embedded name, HF directory or .gguf file")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-model-len", type=int, default=4096)
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--quantization", choices=["auto", "none", *QUANTIZATION_METHODS], default="auto",
                     help="weight format of the model: auto (default: int8 on CPU), none (float weights), int8 "
                          "or int4 (4-bit: a draft's format)")
    gen.add_argument("--method", default="auto",
                     help="speculation method: auto (default: draft_model with the embedded 0.5B draft for the "
                          "embedded target, or with --draft; none for other models), none (plain decoding), "
                          "draft_model, ngram (prompt lookup), suffix, medusa, eagle, eagle3 or mtp (heads / draft layer / modules from "
                          "`specdec train-heads`)")
    gen.add_argument("--draft", default=None, help=f"draft model for --method draft_model (default {zoo.DEFAULT_DRAFT_MODEL}); "
                                                    "medusa, eagle, eagle3, mtp: a heads / layer / modules directory (default: the target's "
                                                    "trained ones)")
    gen.add_argument("--num-speculative-tokens", type=int, default=None,
                     help="γ: the most tokens a step drafts (default 8; suffix: its tree depth, 24; medusa: its "
                          "token tree's depth; eagle, eagle3: 4; mtp: 1)")
    gen.add_argument("--eagle-topk", type=int, default=None,
                     help="eagle, eagle3, draft_model: candidates expanded per depth (1: a chain, default; > 1: EAGLE-2's dynamic tree)")
    gen.add_argument("--num-draft-tokens", type=int, default=None, help="eagle, eagle3, draft_model: the dynamic tree's nodes (default 8)")
    gen.add_argument("--no-adaptive", action="store_true",
                     help="draft γ tokens every step instead of letting the engine choose γ from measured acceptance and cost")
    gen.add_argument("--draft-confidence-threshold", type=float, default=None,
                     help="draft_model: stop drafting after a token the draft gives less than this probability")
    gen.add_argument("--prompt-lookup-min", type=int, default=None, help="ngram: shortest n-gram matched (vLLM rule: defaults to max)")
    gen.add_argument("--prompt-lookup-max", type=int, default=None, help="ngram: longest n-gram matched (default 5)")
    gen.add_argument("--draft-quantization", choices=["auto", "none", *QUANTIZATION_METHODS], default="auto",
                     help="weight format of the draft model: auto (default: int4 on a CPU with AVX-512 VNNI, else "
                          "int8), none, int8 or int4")
    gen.add_argument("--json", action="store_true", help="print output and metrics as one JSON object")
    gen.set_defaults(run=_generate)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (vLLM's flags)")
    serve.add_argument("model", nargs="?", default=zoo.DEFAULT_MODEL, help="embedded name, HF directory or .gguf file")
    serve.add_argument("--speculative-config", default="auto",
                       help='vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 8}\'; auto (default): '
                            f'the embedded {zoo.DEFAULT_DRAFT_MODEL} drafts for the embedded target with adaptive γ ≤ '
                            f'{DEFAULT_MAX_GAMMA}, no speculation for other models; none: no speculation')
    serve.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1: only this machine can connect")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' on /v1 routes "
                                                       "(default: $SPECDEC_API_KEY; none: open)")
    serve.add_argument("--served-model-name", default=None, help="the name clients pass as 'model' (default: MODEL)")
    serve.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together (KV slots)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="tokens one step's forward takes in: decoding sequences first, then prompt chunks")
    serve.add_argument("--max-model-len", type=int, default=4096)
    serve.add_argument("--dtype", default="float32")
    serve.add_argument("--quantization", choices=["auto", "none", *QUANTIZATION_METHODS], default="auto")
    serve.add_argument("--seed", type=int, default=0)
    serve.set_defaults(run=_serve)

    models = commands.add_parser("models", help="embedded models")
    models_commands = models.add_subparsers()
    models_list = models_commands.add_parser("list", help="show embedded models and their state")
    models_list.add_argument("--json", action="store_true")
    models_list.set_defaults(run=_models_list)

    train = commands.add_parser("train-heads", help="train draft heads for a target by self-distillation (CPU)")
    train.add_argument("--method", choices=["medusa", "eagle", "eagle3", "mtp"], required=True)
    train.add_argument("--model", default=zoo.DEFAULT_MODEL, help="the target: embedded name, HF directory or .gguf file")
    train.add_argument("--out", default=None, help="heads directory (default: $SPECDEC_CACHE/heads/<method>/<model>, "
                                                    "where speculative_config finds them without 'model')")
    train.add_argument("--data", default=None, help="directory of the corpus's target hidden states, shared between "
                                                    "methods (default: OUT/data)")
    train.add_argument("--num-heads", type=int, default=None, help="medusa: heads (default 4); mtp: modules (default 2)")
    train.add_argument("--num-layers", type=int, default=1, help="medusa: residual blocks per head")
    train.add_argument("--intermediate-size", type=int, default=None,
                       help="eagle, eagle3, mtp: the draft layer's (each module's) MLP width (default 2048; 0: the target's)")
    train.add_argument("--token-weight", type=float, default=None,
                       help="eagle: the token loss's weight beside the feature loss (default 1.0; EAGLE's is 0.1)")
    train.add_argument("--vocab-size", type=int, default=32_768,
                       help="the heads' output vocabulary: the corpus's most frequent tokens (0: all)")
    train.add_argument("--corpus-tokens", type=int, default=60_000, help="tokens of standard-library source")
    train.add_argument("--generated-tokens", type=int, default=4_096, help="tokens the target generates itself")
    train.add_argument("--epochs", type=int, default=None, help="default: medusa 2, eagle / eagle3 / mtp 4")
    train.add_argument("--batch-size", type=int, default=None,
                       help="positions per step (medusa, default 128) or corpus chunks per step (eagle, eagle3, default 1)")
    train.add_argument("--lr", type=float, default=None, help="learning rate (medusa 1e-3, eagle / eagle3 / mtp 5e-4)")
    train.add_argument("--quantization", choices=["auto", "none", *QUANTIZATION_METHODS], default="auto",
                       help="the target's weight format while it reads the corpus (use the one you serve)")
    train.set_defaults(run=_train_heads)

    bench = commands.add_parser("bench", help="benchmarks (see specdec/bench); without a name: the sweep")
    bench.add_argument("name", help="benchmark: sweep (default), plain_decode, draft_model, cost_curve, ngram, gamma_trace, serve_load, cuda")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(run=_bench)
    return parser


def _format(choice: str) -> str | None:
    return None if choice == "none" else choice


def _train_heads(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec import LLM
    from specdec.models.eagle import default_eagle_dir
    from specdec.models.eagle3 import default_eagle3_dir
    from specdec.models.medusa import default_heads_dir
    from specdec.models.mtp import default_mtp_dir
    from specdec.training.data import CorpusConfig
    from specdec.training.eagle import EagleTrainingConfig, train_eagle
    from specdec.training.medusa import MedusaTrainingConfig, train_medusa
    from specdec.training.mtp import MtpTrainingConfig, train_mtp

    corpus = CorpusConfig(args.corpus_tokens, args.generated_tokens)
    given = {name: value for name, value in (("batch_size", args.batch_size), ("learning_rate", args.lr),
                                             ("epochs", args.epochs)) if value is not None}
    if args.method != "medusa":  # a draft layer per module: batches of corpus chunks, an MLP width
        if "batch_size" in given:
            given["batch_chunks"] = given.pop("batch_size")
        if args.intermediate_size is not None:
            given["intermediate_size"] = args.intermediate_size or None
    if args.method == "medusa":
        config = MedusaTrainingConfig(args.num_heads or 4, args.num_layers, args.vocab_size, **given)
        out, train = Path(args.out) if args.out else default_heads_dir(args.model), train_medusa
    elif args.method == "mtp":
        config = MtpTrainingConfig(args.num_heads or 2, vocab_size=args.vocab_size, **given)
        out, train = Path(args.out) if args.out else default_mtp_dir(args.model), train_mtp
    else:
        if args.token_weight is not None:
            given["token_weight"] = args.token_weight
        eagle3 = args.method == "eagle3"
        config = EagleTrainingConfig(vocab_size=args.vocab_size, eagle3=eagle3, **given)
        out = Path(args.out) if args.out else (default_eagle3_dir if eagle3 else default_eagle_dir)(args.model)
        train = train_eagle
    llm = LLM(args.model, quantization=_format(args.quantization))
    data = Path(args.data) if args.data else None
    report = train(llm, out, corpus, config, data)
    print(json.dumps({"heads": str(out), "before": report["before"], "after": report["after"]}, indent=2))
    return 0


def auto_speculative_config(model: str) -> dict | None:
    """The default: the embedded target speculates with the embedded 0.5B draft and adaptive γ (never slower than
    plain decoding in the bench, BENCHMARKS.md); another model has no known draft and decodes plain."""
    if model != zoo.DEFAULT_MODEL:
        return None
    return {"method": "draft_model", "model": zoo.DEFAULT_DRAFT_MODEL, "num_speculative_tokens": DEFAULT_MAX_GAMMA}


def _generate(args: argparse.Namespace) -> int:
    from specdec import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        seed=args.seed,
    )
    if not args.prompt:
        raise ValueError("the prompt is empty")
    if args.model in zoo.EMBEDDED_MODELS and not zoo.status(zoo.EMBEDDED_MODELS[args.model])["converted"]:
        print(f"[specdec] first use of {args.model}: assembling and converting its weights (about 2 minutes)", file=sys.stderr)
    start = time.perf_counter()
    speculative_config = None
    method = args.method
    if method == "auto":
        method = "draft_model" if args.draft is not None or auto_speculative_config(args.model) else "none"
    if method != "none":
        gamma = args.num_speculative_tokens or (None if method in ("suffix", "medusa", "eagle", "eagle3", "mtp") else DEFAULT_MAX_GAMMA)
        speculative_config = {"method": method, "num_speculative_tokens": gamma, "adaptive": not args.no_adaptive,
                              "model": args.draft, "quantization": _format(args.draft_quantization),
                              "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
        if args.draft_confidence_threshold is not None:
            speculative_config["draft_confidence_threshold"] = args.draft_confidence_threshold
        if args.eagle_topk is not None:
            speculative_config["speculative_eagle_topk"] = args.eagle_topk
        if args.num_draft_tokens is not None:
            speculative_config["speculative_num_draft_tokens"] = args.num_draft_tokens
    llm = LLM(args.model, speculative_config=speculative_config, dtype=args.dtype,
              quantization=_format(args.quantization), max_model_len=args.max_model_len)
    load_s = time.perf_counter() - start
    prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    final = None
    shown = 0
    for output in llm.stream(prompt, params):
        final = output
        if not args.json:
            text = output.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    assert final is not None  # stream yields at least once for a valid request
    completion = final.outputs[0]
    if args.json:
        print(json.dumps({
            "model": args.model,
            "prompt": args.prompt,
            "text": completion.text,
            "token_ids": completion.token_ids,
            "finish_reason": completion.finish_reason,
            "load_s": load_s,
            "metrics": final.metrics.to_dict(),
        }))
    else:
        print()  # end the streamed text's line
        m = final.metrics
        spec = ""
        sd = m.speculative_decoding
        if sd and sd["num_spec_steps"]:
            spec = (f", acceptance {sd['draft_acceptance_rate']:.2f}, mean accepted length "
                    f"{sd['mean_acceptance_length']:.2f}, α {sd['alpha']:.2f}")
        if sd:
            spec += ", steps per γ " + " ".join(f"{g}:{n}" for g, n in enumerate(sd["gamma_histogram"]) if n)
        print(
            f"[specdec] {m.num_output_tokens} tokens, {m.tokens_per_s:.2f} tok/s, TTFT {m.ttft_s:.2f} s{spec}, "
            f"finish: {completion.finish_reason}",
            file=sys.stderr,
        )
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os

    from specdec import LLM
    from specdec.server.app import GracefulServer, build_app

    speculative_config = None
    if args.speculative_config == "auto":
        speculative_config = auto_speculative_config(args.model)
    elif args.speculative_config != "none":
        try:
            speculative_config = json.loads(args.speculative_config)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not valid JSON, auto or none: {error}") from None
    llm = LLM(args.model, speculative_config=speculative_config, dtype=args.dtype,
              quantization=_format(args.quantization), max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)
    app = build_app(llm, args.served_model_name or args.model, args.api_key or os.environ.get("SPECDEC_API_KEY"))
    # on SIGINT/SIGTERM: stop accepting, let running requests finish for up to 30 s, then cancel what is left
    GracefulServer(app, args.host, args.port, grace_s=30).run()
    return 0


def _models_list(args: argparse.Namespace) -> int:
    rows = [zoo.status(m) for m in zoo.EMBEDDED_MODELS.values()]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"cache: {zoo.cache_dir()}")
    for row in rows:
        state = "converted" if row["converted"] else "assembled" if row["assembled"] else (
            "packages installed" if row["packages_installed"] else "not installed"
        )
        default = " (default)" if row["name"] == zoo.DEFAULT_MODEL else ""
        print(f"{row['name']:<22} {state:<20} {row['gguf_bytes'] / 1e9:5.2f} GB  {row['description']}{default}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from specdec.bench import run_benchmark

    return run_benchmark(args.name, args.bench_args)


if __name__ == "__main__":
    sys.exit(main())
