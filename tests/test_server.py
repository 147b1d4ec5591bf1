"""The OpenAI-compatible server on tiny models, through the real `openai` client and raw HTTP: completions,
chat, streaming, concurrency equal to LLM.generate, disconnects, API keys, error bodies, metrics, and a
schemathesis run over the served schema."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.server.app import GracefulServer, build_app

MODEL = "tiny"
KEY = "sk-test"
SPEC = {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}


class Server:
    """uvicorn on a free loopback port, in a thread."""

    def __init__(self, llm: LLM, api_key: str | None = None, grace_s: float = 30) -> None:
        self.llm = llm
        self.app = build_app(llm, MODEL, api_key)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = GracefulServer(self.app, "127.0.0.1", self.port, grace_s=grace_s, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", max_retries=0, timeout=120)

    def metric(self, name: str) -> float:
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def wait_idle(llm: LLM, timeout: float = 10) -> None:
    """Every sequence gone and every KV slot (target and draft) free."""
    deadline = time.time() + timeout
    engine = llm.engine
    while True:
        draft_cache = getattr(engine.proposer, "cache", None)
        idle = (not engine.running and not engine.waiting and engine.cache.num_free_slots == engine.cache.num_slots
                and (draft_cache is None or draft_cache.num_free_slots == draft_cache.num_slots))
        if idle:
            return
        assert time.time() < deadline, "sequences or KV slots still held"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def llm(tiny_qwen, tiny_qwen_draft) -> LLM:
    return LLM(str(tiny_qwen), speculative_config={**SPEC, "model": str(tiny_qwen_draft)}, quantization=None,
               max_model_len=128, max_num_seqs=4)


@pytest.fixture(scope="module")
def server(llm):
    server = Server(llm, api_key=KEY)
    yield server
    server.stop()


GREEDY = dict(temperature=0, max_tokens=20)


def test_completion_equals_generate_and_reports_usage(server, llm):
    response = server.client().completions.create(model=MODEL, prompt="def add(a, b):", **GREEDY)
    [expected] = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    [choice] = response.choices
    assert choice.text == expected.outputs[0].text and choice.finish_reason == "length"
    usage = response.usage
    assert usage.prompt_tokens == len(expected.prompt_token_ids) and usage.completion_tokens == 20
    assert usage.total_tokens == usage.prompt_tokens + 20
    extra = usage.model_extra
    assert extra["num_draft_tokens"] > 0 and 0 <= extra["num_accepted_tokens"] <= extra["num_draft_tokens"]
    assert extra["mean_acceptance_length"] >= 1
    wait_idle(llm)


def test_chat_and_models(server, llm):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    messages = [{"role": "user", "content": "hi"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    [expected] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streaming_deltas_add_up(server):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt="stream me", **GREEDY).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="stream me", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True,
                                               n=2, **GREEDY))
    for index in range(2):
        deltas = [c.choices[0].delta for c in chat if c.choices[0].index == index]
        assert deltas[0].role == "assistant"
        assert "".join(d.content or "" for d in deltas) == chat_text(client, "x")


def chat_text(client, content: str) -> str:
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **GREEDY)
    return response.choices[0].message.content


def test_sampled_requests_with_n_and_stop_equal_generate(server, llm):
    """A seeded request samples the same tokens served (batched with others) as through LLM.generate."""
    params = dict(temperature=0.8, top_p=0.95, max_tokens=16, seed=5, n=2, stop=["e"])
    response = server.client().completions.create(model=MODEL, prompt="sample me", **params)
    [expected] = llm.generate("sample me", SamplingParams(**params), use_tqdm=False)
    assert [c.text for c in response.choices] == [o.text for o in expected.outputs]
    assert [c.finish_reason for c in response.choices] == [o.finish_reason for o in expected.outputs]


def test_concurrent_requests_equal_generate(server, llm):
    """More clients than sequences in the batch (4): requests queue, join and leave between steps, each
    accepting a different number of drafts per step, and every output is plain greedy's."""
    prompts = [f"request {i}: " + "abc " * (i % 5) for i in range(16)]
    lengths = [8 + (i * 7) % 25 for i in range(16)]
    client = server.client()

    def ask(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=prompts[i], temperature=0, max_tokens=lengths[i]).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(ask, range(16)))
    plain = LLM(str(llm.config.model), quantization=None, max_model_len=128, max_num_seqs=1)
    for prompt, length, text in zip(prompts, lengths, texts):
        [expected] = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=length), use_tqdm=False)
        assert text == expected.outputs[0].text
    wait_idle(llm)


def test_disconnect_mid_stream_frees_the_sequence(server, llm):
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 100, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as response:
        assert response.status_code == 200
        events = response.iter_lines()
        first = next(line for line in events if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
    wait_idle(llm)  # the client left after one chunk: its sequence and KV slots are free
    assert server.metric("specdec:kv_cache_usage_perc") == 0
    assert server.metric("specdec:num_requests_running") == 0


def test_api_key_is_required_on_v1_routes(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    response = httpx.get(f"{server.url}/v1/models")
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open
    assert httpx.get(f"{server.url}/metrics").status_code == 200


@pytest.mark.parametrize("body, status, param", [
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": [[]]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x " * 300}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, 400, None),
])
def test_bad_requests_get_openai_error_bodies(server, llm, body, status, param):
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert param in (error["param"] or "") or param in error["message"]
    wait_idle(llm)


def test_malformed_json_and_bad_chat(server, llm):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    response = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers=headers)
    assert response.status_code == 400 and response.json()["error"]["message"]
    for messages in ([], [{"role": "wizard", "content": "x"}], [{"content": "x"}]):
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": messages},
                              headers=headers)
        assert response.status_code == 400, response.text
    wait_idle(llm)


def test_logprobs_are_the_targets(server, llm):
    client = server.client()
    response = client.completions.create(model=MODEL, prompt="log", logprobs=3, **GREEDY)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 20 and len(logprobs.top_logprobs) == 20
    # keyed by text, as OpenAI's format is: tokens that decode alike (partial UTF-8) share a key
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and value == pytest.approx(max(top.values()))  # greedy: the chosen token is the likeliest
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True,
                                          top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 20 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy: the likeliest


def test_metrics_counters_move(server):
    before = server.metric("specdec:spec_decode_num_draft_tokens_total")
    generated = server.metric("specdec:generation_tokens_total")
    server.client().completions.create(model=MODEL, prompt="count me", **GREEDY)
    assert server.metric("specdec:spec_decode_num_draft_tokens_total") > before
    assert server.metric("specdec:generation_tokens_total") == generated + 20
    assert server.metric("specdec:spec_decode_num_accepted_tokens_per_pos_total") == server.metric(
        "specdec:spec_decode_num_accepted_tokens_total")
    assert server.metric("specdec:time_to_first_token_seconds_count") >= 1


def test_an_engine_failure_fails_its_requests_not_the_server(server, llm, monkeypatch):
    step = llm.engine.step
    calls = []

    def failing_once() -> list:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return step()

    monkeypatch.setattr(llm.engine, "step", failing_once)
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 500 and "injected" in response.json()["error"]["message"]
    wait_idle(llm)
    assert server.client().completions.create(model=MODEL, prompt="x", **GREEDY).usage.completion_tokens == 20


def test_graceful_shutdown_cancels_what_still_runs(llm, monkeypatch):
    """Running responses may finish within the grace period; then the server cancels the rest itself: the
    client gets an error event and [DONE], and every sequence and KV slot is freed."""
    step = llm.engine.step

    def slow_step() -> list:  # the tiny model decodes 120 tokens within the grace period on a fast host
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    server = Server(llm, grace_s=0.3)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 120, "temperature": 0, "stream": True, "ignore_eos": True}
    lines: list[str] = []

    def consume() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines.extend(response.iter_lines())

    client = threading.Thread(target=consume)
    client.start()
    deadline = time.time() + 10
    while not llm.engine.running:
        assert time.time() < deadline
        time.sleep(0.01)
    server.stop()
    client.join(timeout=30)
    assert not server.thread.is_alive()
    wait_idle(llm)
    events = [line[6:] for line in lines if line]
    assert events[-1] == "[DONE]" and "shut down" in json.loads(events[-2])["error"]["message"]
    assert all(json.loads(e)["choices"] for e in events[:-2])  # the chunks sent before


def test_schemathesis_finds_no_server_error(llm):
    """Generated requests against the served OpenAPI schema: 4xx where they are bad, never a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    server = Server(llm)
    try:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        statuses: list[int] = []
        for result in schema.get_all_operations():
            operation = result.ok()

            @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                      derandomize=True)
            @given(case=operation.as_strategy())
            def check(case):
                if isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = MODEL  # else nearly every case stops at the 404 for an unknown model
                response = case.call_and_validate(base_url=server.url, checks=[not_a_server_error], timeout=60)
                statuses.append(response.status_code)

            check()
        assert statuses.count(200) >= 20 and any(400 <= code < 500 for code in statuses)  # both paths taken
        wait_idle(llm)
    finally:
        server.stop()
