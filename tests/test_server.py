"""The OpenAI-compatible server on loopback, driven by the official openai client and raw
HTTP: models, completions, chat, streaming, usage, error bodies, disconnects, shutdown."""
import array
import asyncio
import atexit
import gc
import gzip
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import tracemalloc
import types
import weakref

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from transformers import AutoTokenizer

import diffuserve as ds
from diffuserve import server as server_module
from diffuserve.async_llm import AsyncLLM, EngineDead, Progress, StepFailed
from diffuserve.protocol import MAX_CHOICES, ApiError, ChatCompletionRequest, CompletionRequest, parse
from diffuserve.chat_template import names_role
from diffuserve.random_checkpoint import write_random_checkpoint
from diffuserve.server import build_app
from diffuserve import stop_strings
from diffuserve.stop_strings import TokensThrough

from chat_checkpoint import (CHAT_TEMPLATE, CLEAN_UP_CORPUS, MODEL_CONFIG, write_chat_checkpoint,
                             write_clean_up_tokenizer)

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def base_url(checkpoint):
    app = build_app(AsyncLLM(ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20)), MODEL)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(checkpoint):
    return ds.LLM(checkpoint)


def wait_until_idle(engine, seconds):
    """Waits (at most `seconds`) for the engine's stats to show no request running or waiting
    and every KV block free: its thread refreshes them after posting a step's outputs."""
    deadline = time.time() + seconds
    while engine.stats["kv_blocks_free"] != engine.stats["kv_blocks_total"] or engine.stats["running"] \
            or engine.stats["waiting"]:
        assert time.time() < deadline, engine.stats
        time.sleep(0.02)


async def stream_to_the_end(engine, prompt, params):
    """Runs one AsyncLLM request to its end; returns its output."""
    async for progress in engine.generate(prompt, params):
        last = progress
    return last.output


def metrics(base_url) -> dict:
    text = httpx.get(base_url + "/metrics").text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^(diffuserve_\w+(?:\{(?:[^}"]|"[^"]*")*\})?) (\S+)$', text, re.M)}


def test_metrics_series_exist_from_the_start(offline):
    """Each finish reason's series is there at 0 before its first request (an alert's rate() or
    increase() had missed the first error or abort), and the prefix cache counts tokens."""
    from diffuserve.metrics import Metrics
    text = Metrics(offline.stats).exposition().decode()
    for reason in ("stop", "length", "abort", "error"):
        assert f'diffuserve_requests_total{{finish_reason="{reason}"}} 0.0' in text
    assert "# HELP diffuserve_prefix_cache_hits_total Prompt tokens found in the prefix cache" in text


def test_latency_histograms_count_each_choice(client, base_url):
    """vLLM's end-to-end, first-output and queue latencies (there had been none): each choice's
    seconds from its request's arrival to its end, to its first committed block where it had
    one, and to the engine step that first ran it."""
    before = metrics(base_url)
    started = time.monotonic()
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, seed=1, n=3,
                                    extra_body={"ignore_eos": True})
    took = time.monotonic() - started
    after = metrics(base_url)
    added = {name: after[name] - before.get(name, 0) for name in after}
    for name in ("diffuserve_e2e_request_latency_seconds", "diffuserve_time_to_first_block_seconds",
                 "diffuserve_request_queue_time_seconds"):
        assert added[name + "_count"] == len(out.choices) == 3
        assert 0 < added[name + "_sum"] <= 3 * took
    # (three blocks each: the first comes before the end, and after the step that began it)
    assert added["diffuserve_request_queue_time_seconds_sum"] < added["diffuserve_time_to_first_block_seconds_sum"] \
        < added["diffuserve_e2e_request_latency_seconds_sum"]


def test_http_responses_are_counted_by_endpoint_method_and_status(base_url):
    """/metrics counts each response (as vLLM's http_requests_total): a refused request shows as
    a 400 of its endpoint (none had shown anywhere); a path outside the API is "other"."""
    def series(handler, method, status):
        return f'diffuserve_http_requests_total{{handler="{handler}",method="{method}",status="{status}"}}'

    before = metrics(base_url)
    assert httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}).status_code \
        == 400
    assert httpx.get(base_url + "/v1/models").status_code == 200
    assert httpx.get(base_url + "/v1/models/nobody").status_code == 404
    assert httpx.get(base_url + "/no/such/path").status_code == 404
    assert httpx.request("PATCH", base_url + "/health").status_code == 405
    after = metrics(base_url)
    for key in (series("/v1/completions", "POST", 400), series("/v1/models", "GET", 200),
                series("/v1/models/{model}", "GET", 404), series("other", "GET", 404), series("/health", "other", 405)):
        assert after[key] - before.get(key, 0) == 1, key
    assert not any("no/such" in key for key in after)


def test_http_durations_run_to_a_streams_end(base_url):
    """/metrics times each response by endpoint and method (as vLLM's
    http_request_duration_seconds) to its last byte: a stream's duration covers its blocks,
    not just the time to its headers."""
    series = '{handler="/v1/completions",method="POST"}'
    before = metrics(base_url)
    start = time.monotonic()
    with httpx.stream("POST", base_url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": 48, "seed": 3, "stream": True}) as r:
        lines = [(time.monotonic() - start, line) for line in r.iter_lines() if line]
    elapsed = time.monotonic() - start
    assert len(lines) > 2 and lines[-1][1] == "data: [DONE]"
    deadline = time.time() + 10  # (observed once the app returns, just after the last byte went out)
    while (after := metrics(base_url)).get(f"diffuserve_http_request_duration_seconds_count{series}", 0) \
            == before.get(f"diffuserve_http_request_duration_seconds_count{series}", 0):
        assert time.time() < deadline
        time.sleep(0.02)
    added = {name: after[f"diffuserve_http_request_duration_seconds_{name}{series}"]
             - before.get(f"diffuserve_http_request_duration_seconds_{name}{series}", 0) for name in ("count", "sum")}
    assert added["count"] == 1
    assert lines[0][0] < lines[-1][0] <= added["sum"] + 0.05 and added["sum"] <= elapsed


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # had been a 404
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("other")
    assert httpx.get(base_url + "/health").status_code == 200
    assert httpx.head(base_url + "/health").status_code == 200  # as load balancers' checks ask (had been a 405)
    assert httpx.head(base_url + "/metrics").status_code == 200  # (so too)
    # vLLM's /ping (SageMaker's check, GET or POST) and /version
    assert httpx.get(base_url + "/ping").status_code == httpx.post(base_url + "/ping").status_code == 200
    assert httpx.get(base_url + "/version").json() == {"version": ds.__version__}


def test_completion_matches_offline_generation(client, offline):
    out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=40, seed=7)
    expected = offline.generate(["Hello world"], ds.SamplingParams(max_new_tokens=40, seed=7))[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.model_extra["denoise_steps"] == sum(expected.denoise_steps)


def test_completion_token_prompt_batch_and_n(client, offline, base_url):
    ids = offline.tokenizer.encode("Hi")
    before = metrics(base_url)["diffuserve_prompt_tokens_total"]
    out = client.completions.create(model=MODEL, prompt=[ids, "Hello world"], max_tokens=16, seed=3, n=2)
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    texts = {c.index: c.text for c in out.choices}
    expected = offline.generate([ids, ids, "Hello world", "Hello world"],
                                [ds.SamplingParams(max_new_tokens=16, seed=s) for s in (3, 4, 3, 4)])
    assert [texts[i] for i in range(4)] == [e.text for e in expected]
    assert out.usage.prompt_tokens == len(ids) + len(expected[2].prompt_token_ids)  # each prompt counted once
    # and so in /metrics (it had counted each prompt once per choice)
    assert metrics(base_url)["diffuserve_prompt_tokens_total"] - before == out.usage.prompt_tokens


def test_chat_stream_equals_chat(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=48, seed=11)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=48, seed=11,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_offline_stop_strings_end_outputs_as_the_servers_do(client, offline):
    """SamplingParams.stop (vLLM's) ends an offline output as the server's stop ends a choice:
    the same text (cut before the stop string, or after it with include_stop_str_in_output),
    the tokens through the one that ends it, finish_reason "stop" and the string as its
    stop_reason; a request whose text so far holds one is aborted, its later blocks not run."""
    stopped = early = 0
    for seed in range(6):
        for stop, include in ((["e"], False), ([" ", "o"], True), (["zzz"], False)):
            served = client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, seed=seed, stop=stop,
                                               extra_body={"include_stop_str_in_output": include})
            out = offline.generate(["Hello"], ds.SamplingParams(max_new_tokens=40, seed=seed, stop=stop,
                                                                include_stop_str_in_output=include))[0]
            choice = served.choices[0]
            assert (out.text, out.finish_reason, out.stop_reason) == (choice.text, choice.finish_reason,
                                                                      choice.model_extra["stop_reason"])
            assert len(out.token_ids) == served.usage.completion_tokens
            assert out.outputs[0].stop_reason == out.stop_reason
            if isinstance(out.stop_reason, str):
                stopped += 1
                whole = offline.generate(["Hello"], ds.SamplingParams(max_new_tokens=40, seed=seed))[0]
                assert whole.token_ids[:len(out.token_ids)] == out.token_ids and out.seed == whole.seed
                early += len(out.denoise_steps) < len(whole.denoise_steps)
    assert stopped >= 6 and early >= 1
    # An id that ends the output (offline eos_token_id, the server's stop_token_ids) as the server's
    # stop token: the id as stop_reason, its text too with include_stop_str_in_output (offline had
    # given no stop_reason and dropped the text).
    a = offline.tokenizer.encode("a", add_special_tokens=False)[0]
    allowed = sorted(set(offline.tokenizer.encode("Hello world the fox", add_special_tokens=False))) + [a]
    eos = offline.model.config["generation"]["eos_token_ids"]
    by_id = 0
    for seed in range(10):
        for include in (False, True):
            served = client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, seed=seed, extra_body={
                "stop_token_ids": [a], "allowed_token_ids": allowed, "include_stop_str_in_output": include})
            out = offline.generate(["Hello"], ds.SamplingParams(max_new_tokens=40, seed=seed, eos_token_id=eos + [a],
                                                                allowed_token_ids=allowed,
                                                                include_stop_str_in_output=include))[0]
            choice = served.choices[0]
            assert (out.text, out.finish_reason, out.stop_reason) == (choice.text, choice.finish_reason,
                                                                      choice.model_extra["stop_reason"])
            by_id += out.stop_reason == a
    assert by_id >= 2
    # A stopped output's tokens per forward as the runtime counts them: its finished blocks' tokens
    # but the pad id (which it had counted) per decoder pass.
    pad, canvas = offline.model.config["generation"]["pad_token_id"], offline.model.canvas_length
    x, q = (offline.tokenizer.encode(c, add_special_tokens=False)[0] for c in "xq")
    cut = 0
    for seed in range(30):
        params = dict(max_new_tokens=6 * canvas, seed=seed, allowed_token_ids=[pad, x, q], eos_token_id=[])
        whole = offline.generate([[5, 6]], ds.SamplingParams(**params))[0]
        out = offline.generate([[5, 6]], ds.SamplingParams(**params, stop="q"))[0]
        if out.stop_reason == "q" and len(out.denoise_steps) < len(whole.denoise_steps):
            blocks = whole.token_ids[:len(out.denoise_steps) * canvas]
            assert out.tokens_per_forward == pytest.approx(sum(t != pad for t in blocks) / sum(out.denoise_steps))
            cut += pad in blocks
    assert cut
    unseeded = offline.generate(["Hello"], ds.SamplingParams(max_new_tokens=40, stop=["e", " "]))[0]
    again = offline.generate(["Hello"], ds.SamplingParams(max_new_tokens=40, stop=["e", " "], seed=unseeded.seed))[0]
    assert again.token_ids == unseeded.token_ids  # (the seed it reports is the one it ran with)
    with pytest.raises(ValueError, match="stop: an empty string is not a stop string"):
        ds.SamplingParams(stop="")
    with pytest.raises(ValueError, match=r"stop\[1\] must be a string, got 3"):
        ds.SamplingParams(stop=["a", 3])


def test_llm_chat_is_the_servers_chat(client, offline):
    """LLM.chat, as vLLM's: the template's text encoded without a second <bos> (generate given that
    text adds the tokenizer's own), so the same tokens as the server's chat; one conversation
    or a list of them."""
    talks = [[{"role": "developer", "content": "Be brief."},  # (as the server, a system turn for this template)
              {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
             [{"role": "user", "content": "Hello world"}]]
    params = ds.SamplingParams(max_new_tokens=24, seed=5)
    outs = offline.chat(talks, params)
    for messages, out in zip(talks, outs):
        served = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, seed=5)
        assert out.text == served.choices[0].message.content and out.finish_reason == served.choices[0].finish_reason
        assert len(out.prompt_token_ids) == served.usage.prompt_tokens
        # (vLLM's prompt: the rendered conversation, whose ids are the prompt's)
        assert offline.tokenizer.encode(out.prompt, add_special_tokens=False) == out.prompt_token_ids
    bos = offline.tokenizer.encode("", add_special_tokens=True)
    assert outs[1].prompt_token_ids[:len(bos) + 1] != bos * 2  # the template's <bos> alone
    assert offline.chat(talks[1], params)[0].token_ids == outs[1].token_ids
    assert offline.chat(talks[1], sampling_params=params)[0].token_ids == outs[1].token_ids  # (vLLM's keyword)
    prefilled = talks[1] + [{"role": "assistant", "content": "Well"}]
    continued = offline.chat(prefilled, params, continue_final_message=True)[0]
    assert len(continued.prompt_token_ids) > len(outs[1].prompt_token_ids)
    for bad, message in [({"role": "user", "content": "x"}, "messages must be a conversation"),
                         ([], "messages must be a conversation"),
                         ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                          r"conversation 0: messages\[0\].content\[0\]: content part of type 'image_url' is not "),
                         ((talks[1], {"add_generation_prompt": False}), "may not set add_generation_prompt")]:
        args = (bad,) if not isinstance(bad, tuple) else (bad[0],)
        kwargs = {} if not isinstance(bad, tuple) else {"chat_template_kwargs": bad[1]}
        with pytest.raises(ValueError, match=message):
            offline.chat(*args, params, **kwargs)


def test_stop_strings(client, offline):
    full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=48, seed=2).choices[0].text
    stop = full[20:23]
    cut = full[:full.index(stop)]
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=48, seed=2, stop=[stop, "never"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    assert out.usage.model_extra["denoise_steps"] > 0  # the blocks' steps count, a stop string ending it or not
    # The tokens generated count up to the one that ends the stop string (they had counted whole blocks).
    ids = offline.generate([offline.tokenizer.encode("Hello")], ds.SamplingParams(max_new_tokens=48, seed=2))[0] \
        .token_ids
    # (Not by the decoded text's length: a token that ends inside a character decodes to a
    # replacement character that holds its place.)
    decoded = offline.tokenizer.decode_output
    expected = next(k for k in range(1, len(ids) + 1) if decoded(ids[:k]).startswith(cut + stop))
    assert out.usage.completion_tokens == expected < len(ids)
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=48, seed=2, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in stream) == cut


def test_temperature_and_diffusion_extensions(client, offline):
    body = dict(model=MODEL, prompt="Hello", max_tokens=16, seed=1)
    cold = client.completions.create(**body, temperature=0)  # near-greedy, still reproducible by its seed
    assert cold.choices[0].text == client.completions.create(**body, temperature=0).choices[0].text
    # Without a seed, 0 is deterministic too, as OpenAI's greedy 0 is: every choice alike (the
    # canvas's noise had still varied the text).
    unseeded = {**body, "seed": None}
    greedy = client.completions.create(**unseeded, temperature=0, n=3)
    assert len({c.text for c in greedy.choices}) == 1
    assert client.completions.create(**unseeded, temperature=0).choices[0].text == greedy.choices[0].text
    # A temperature below the coldest scale samples as 0 does, so as reproducibly (1e-9 had drawn
    # each choice's noise from a seed of its own).
    tiny = client.completions.create(**unseeded, temperature=1e-9, n=2)
    assert [c.text for c in tiny.choices] == [greedy.choices[0].text] * 2
    out = client.completions.create(**body, extra_body=dict(canvas_length=8, max_denoising_steps=3,
                                                            entropy_bound=0.5, t_min=0.1, t_max=0.3))
    assert out.usage.model_extra["denoise_steps"] <= 2 * 3  # two blocks of 8, at most 3 steps each
    allowed = client.completions.create(**body, extra_body=dict(allowed_token_ids=[300, 301]))
    pieces = offline.tokenizer.decode([300]), offline.tokenizer.decode([301])
    assert allowed.choices[0].text and set(allowed.choices[0].text) <= set("".join(pieces))


def test_truncate_prompt_tokens_as_vllms(client, offline, base_url):
    """vLLM's truncate_prompt_tokens: each prompt's last k tokens run, and usage counts them."""
    prompt = offline.tokenizer.encode("Hello world, the quick brown fox jumps")
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, seed=2,
                                    extra_body={"truncate_prompt_tokens": 4})
    plain = client.completions.create(model=MODEL, prompt=prompt[-4:], max_tokens=16, seed=2)
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].text == plain.choices[0].text
    r = httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_logit_bias_as_openais(client, offline):
    """OpenAI's logit_bias (token ids as strings -> -100..100): 100 makes a token the only
    choice, and a bias gives what the offline API gives with the same logit_bias."""
    body = dict(model=MODEL, prompt="Hello", max_tokens=16, seed=3, extra_body={"ignore_eos": True,
                                                                                 "return_token_ids": True})
    only = client.completions.create(**body, logit_bias={"300": 100})
    assert only.choices[0].model_extra["token_ids"] == [300] * 16
    bias = {300: 4.5, 301: 3.0, 7: -100}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=16,
                                         seed=3, logit_bias={str(k): v for k, v in bias.items()})
    conversation = offline.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                         add_generation_prompt=True)
    expected = offline.generate([offline.tokenizer.encode(conversation, add_special_tokens=False)],
                                ds.SamplingParams(max_new_tokens=16, seed=3, logit_bias=bias))[0]
    plain = offline.generate([offline.tokenizer.encode(conversation, add_special_tokens=False)],
                             ds.SamplingParams(max_new_tokens=16, seed=3))[0]
    assert out.choices[0].message.content == expected.text != plain.text


def test_ignore_eos(client, offline):
    """vLLM's ignore_eos: generation runs on past the checkpoint's EOS to max_tokens (it had been
    accepted only as false). Only EOS allowed, a request ends at once without it and runs its
    whole length with it."""
    eos = offline.model.config["generation"]["eos_token_ids"][0]
    body = dict(model=MODEL, prompt="Hello", max_tokens=24, seed=5, extra_body={"allowed_token_ids": [eos]})
    ended = client.completions.create(**body)
    assert (ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("stop", 1)
    whole = client.completions.create(**{**body, "extra_body": {**body["extra_body"], "ignore_eos": True,
                                                                 "return_token_ids": True}})
    assert (whole.choices[0].finish_reason, whole.usage.completion_tokens) == ("length", 24)
    assert whole.choices[0].model_extra["token_ids"] == [eos] * 24
    expected = offline.generate(["Hello"], ds.SamplingParams(max_new_tokens=24, seed=5, allowed_token_ids=[eos],
                                                             eos_token_id=[]))[0]
    assert whole.choices[0].text == expected.text and expected.finish_reason == "length"
    stream = client.completions.create(**{**body, "extra_body": {**body["extra_body"], "ignore_eos": True}},
                                       stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == expected.text and chunks[-1].finish_reason == "length"


def test_a_stop_tokens_text_completes_the_character_before_it(tmp_path):
    """include_stop_str_in_output with a stop id that is a character's last byte: the text ends
    with that character, plain and streamed, as the output's decode has it (the byte before it
    had gone out as U+FFFD, and the stop id's own byte as another)."""
    from fastapi.testclient import TestClient

    path = write_chat_checkpoint(tmp_path / "m", byte_fallback=True)
    llm = ds.LLM(path)
    lead, last = llm.tokenizer.token_id("<0xC3>"), llm.tokenizer.token_id("<0xA9>")  # "é": C3 A9
    other = llm.tokenizer.encode("a", add_special_tokens=False)[0]
    engine = AsyncLLM(llm)
    try:
        with TestClient(build_app(engine, MODEL)) as http:
            for seed in range(100):
                body = {"model": MODEL, "prompt": "Hello", "max_tokens": 32, "seed": seed, "return_token_ids": True,
                        "allowed_token_ids": [lead, last, other], "stop_token_ids": [last],
                        "include_stop_str_in_output": True}
                choice = http.post("/v1/completions", json=body).json()["choices"][0]
                if choice["token_ids"][-2:] == [lead, last]:
                    break
            assert choice["token_ids"][-2:] == [lead, last] and choice["stop_reason"] == last
            expected = llm.tokenizer.decode_output(choice["token_ids"])
            assert choice["text"] == expected and expected.endswith("é")
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                chunks = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                          if line.startswith("data: {")]
            assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    finally:
        engine.shutdown()


def test_a_stop_string_before_a_stop_token_is_found_with_include_stop_str(tmp_path):
    """include_stop_str_in_output with a stop token: the stop strings are still searched for in
    all the text before it, the detokenizer's held-back tail included (the last 32 characters
    of a clean-up tokenizer's text had been left out of the search, and the output ran past a
    stop string to the stop token)."""
    from fastapi.testclient import TestClient

    path = write_random_checkpoint(tmp_path / "m", canvas_length=16, **MODEL_CONFIG)
    write_clean_up_tokenizer(path)
    llm = ds.LLM(path)
    hello, world, stop = (llm.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("hello", "world", "."))
    engine = AsyncLLM(llm)
    found = 0
    try:
        with TestClient(build_app(engine, MODEL)) as http:
            for seed in range(40):
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 16, "seed": seed, "stop": ["world"],
                        "allowed_token_ids": [hello, world, stop], "stop_token_ids": [stop]}
                plain = http.post("/v1/completions", json=body).json()["choices"][0]
                kept = http.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
                kept = kept["choices"][0]
                assert (kept["finish_reason"], kept["stop_reason"]) == (plain["finish_reason"], plain["stop_reason"])
                if plain["stop_reason"] == "world":
                    found += 1
                    assert kept["text"] == plain["text"] + "world"
    finally:
        engine.shutdown()
    assert found


def test_stop_token_ids_and_stop_reason(client, offline, base_url):
    """vLLM's stop_token_ids end a choice as the EOS does (they had been refused as unknown), with
    ignore_eos too, and each choice's stop_reason says what ended it: the stop string, the stop
    token's id, or null for the checkpoint's EOS (an id that is both is the EOS, as in vLLM)."""
    eos = offline.model.config["generation"]["eos_token_ids"][0]
    body = dict(model=MODEL, prompt="Hello", max_tokens=24, seed=5)

    def ended(extra, stream=False):
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(**body, extra_body=extra, stream=True)]
            assert all(c.model_extra["stop_reason"] is None for c in chunks[:-1])
            return chunks[-1].finish_reason, chunks[-1].model_extra["stop_reason"], "".join(c.text for c in chunks)
        out = client.completions.create(**body, extra_body={**extra, "return_token_ids": True})
        choice = out.choices[0]
        return choice.finish_reason, choice.model_extra["stop_reason"], choice.model_extra["token_ids"]

    assert ended({"allowed_token_ids": [300], "stop_token_ids": [300]}) == ("stop", 300, [300])
    assert ended({"allowed_token_ids": [300], "stop_token_ids": [300]}, stream=True) == ("stop", 300, "")
    assert ended({"allowed_token_ids": [eos], "stop_token_ids": [eos]}) == ("stop", None, [eos])
    assert ended({"allowed_token_ids": [eos], "stop_token_ids": [eos], "ignore_eos": True}) == ("stop", eos, [eos])
    assert ended({"allowed_token_ids": [300], "stop_token_ids": [301]}) == ("length", None, [300] * 24)
    # A stop id among others: the text is the offline generation's through the tokens before it.
    free = offline.generate(["Hello"], ds.SamplingParams(max_new_tokens=24, seed=5))[0]
    stop_id = free.token_ids[5]
    expected = offline.generate(["Hello"], ds.SamplingParams(max_new_tokens=24, seed=5,
                                                             eos_token_id=[eos, stop_id]))[0]
    out = client.completions.create(**body, extra_body={"stop_token_ids": [stop_id]})
    assert (out.choices[0].text, out.choices[0].finish_reason, out.choices[0].model_extra["stop_reason"]) == \
        (expected.text, "stop", stop_id if stop_id != eos else None)
    assert out.usage.completion_tokens == len(expected.token_ids)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          extra_body={"allowed_token_ids": [300], "stop_token_ids": [300]})
    assert (chat.choices[0].finish_reason, chat.choices[0].model_extra["stop_reason"]) == ("stop", 300)
    # The stop string found, and null where a choice ran to its length.
    full = client.completions.create(**body).choices[0]
    stop = full.text[10:13]
    out = client.completions.create(**body, stop=["never", stop])
    assert (out.choices[0].finish_reason, out.choices[0].model_extra["stop_reason"]) == ("stop", stop)
    out = client.completions.create(**body, extra_body={"ignore_eos": True})
    assert (out.choices[0].finish_reason, out.choices[0].model_extra["stop_reason"]) == ("length", None)
    # include_stop_str_in_output (had been accepted only as false): the text ends with what ended
    # it, the tokens counted alike.
    cut = full.text[:full.text.index(stop)]
    without = client.completions.create(**body, stop=[stop])
    out = client.completions.create(**body, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert (out.choices[0].text, without.choices[0].text) == (cut + stop, cut)
    assert out.usage.completion_tokens == without.usage.completion_tokens
    stream = client.completions.create(**body, stop=[stop], stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in stream) == cut + stop
    included = client.completions.create(**body, extra_body={"include_stop_str_in_output": True, "return_token_ids": True,
                                                             "allowed_token_ids": [300], "stop_token_ids": [300]})
    assert (included.choices[0].text, included.choices[0].model_extra["token_ids"]) == \
        (offline.tokenizer.decode([300]), [300])
    eos_ended = client.completions.create(**body, extra_body={"include_stop_str_in_output": True,
                                                              "allowed_token_ids": [eos]})
    assert (eos_ended.choices[0].text, eos_ended.choices[0].finish_reason) == ("", "stop")  # the EOS has no text
    # A stop string inside the stop token's own text does not cut it: the token ended the output.
    piece = offline.tokenizer.decode([300])
    out = client.completions.create(**body, stop=[piece[:1]], extra_body={
        "include_stop_str_in_output": True, "allowed_token_ids": [300], "stop_token_ids": [300]})
    assert (out.choices[0].text, out.choices[0].model_extra["stop_reason"]) == (piece, 300)
    vocab = offline.model.config["vocab_size"]
    for ids, says in (([5, vocab], f"stop_token_ids[1] = {vocab} is out of range [0, {vocab})"),
                      ([-1], "stop_token_ids[0] = -1 is out of range"),
                      (list(range(5000)), "stop_token_ids: 5000 distinct ids, more than a request may give (4096)")):
        r = httpx.post(base_url + "/v1/completions", json={**body, "stop_token_ids": ids})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
        assert says in r.json()["error"]["message"]


def test_stop_reason_names_the_checkpoints_other_eos_ids():
    """As vLLM, whose generation_config EOS ids beyond the tokenizer's EOS are stop tokens: only
    the tokenizer's EOS has a null stop_reason (a Gemma checkpoint's <end_of_turn> had too)."""
    def reason(token, **fields):
        return parse(CompletionRequest, {"model": MODEL, "prompt": "x", **fields}).stop_reason(token, [1, 106], 1)
    assert [reason(1), reason(106), reason(7)] == [None, 106, None]
    assert [reason(1, stop_token_ids=[1]), reason(7, stop_token_ids=[7])] == [None, 7]
    assert [reason(1, ignore_eos=True, stop_token_ids=[1]), reason(106, ignore_eos=True)] == [1, None]


def test_draft_streaming(base_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "seed": 4,
            "stream": True, "stream_drafts": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    drafts = [c["choices"][0]["delta"]["draft"] for c in chunks if "draft" in c["choices"][0]["delta"]]
    assert len(drafts) >= 2  # the canvas seen as it refines, before its block is committed


@pytest.mark.parametrize("path,body,status,param,code", [
    ("completions", "{not json", 400, None, None),
    ("completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": 3}, 400, "temperature", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 0.5}, 400, "top_p", "unsupported_parameter"),
    # logit_bias: OpenAI's range, and keys that are token ids of the vocabulary.
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"3": 100.5}}, 400, "logit_bias.3", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"x3": 1}}, 400, "logit_bias", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"-3": 1}}, 400, "logit_bias", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"3": 1, "03": 2}}, 400, "logit_bias",
     "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"3": "1"}}, 400, "logit_bias.3", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"3": True}}, 400, "logit_bias.3", "invalid_value"),
    # (int() of 5,000 digits raises its own ValueError: it had been a 500)
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias",
     "invalid_value"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": [1]}, 400,
     "logit_bias", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "canvas_length": 64}, 400, "canvas_length", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "allowed_token_ids": [9999]}, 400, "allowed_token_ids",
     "invalid_value"),
    ("completions", {"model": MODEL, "prompt": [5, 99999]}, 400, "prompt", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "seed_canvas": [3, 3]}, 400, "seed_canvas", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "t_min": 0.5, "t_max": 0.2}, 400, "t_max", "invalid_value"),
    # Only t_min sent, above the checkpoint's t_max: the 400 had named t_max, which the client never sent.
    ("completions", {"model": MODEL, "prompt": "x", "t_min": 0.9}, 400, "t_min", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": ["a"] * 257}, 400, "stop", None),
    # Stop strings' length and allowed ids for every choice are bounded in all (a few MB of
    # either had cost seconds of the event loop, or gigabytes for the engine's copies).
    ("completions", {"model": MODEL, "prompt": "x", "stop": ["ab" * 20000, "c" * 25537]}, 400, "stop", None),
    ("completions", {"model": MODEL, "prompt": [[5]] * 32, "n": 128, "allowed_token_ids": list(range(4097))}, 400,
     "allowed_token_ids", None),
    # An empty stop string (had been dropped, as if none were given).
    ("completions", {"model": MODEL, "prompt": "x", "stop": ""}, 400, "stop", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": ["a", ""]}, 400,
     "stop", None),
    # Text longer than any prompt that fits, refused before it is encoded (20 MB had taken 11 GB).
    ("completions", {"model": MODEL, "prompt": "1" * 5_000_000}, 400, "prompt", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "1" * 5_000_000}]}, 400,
     "messages", None),
    # The wrong model is a 404 whatever else the request holds, on either endpoint (completions
    # had answered for max_tokens first).
    ("completions", {"model": "gpt-4", "prompt": "x", "max_tokens": -2}, 404, "model", "model_not_found"),
    # Which of a batch's prompts is wrong (each had been named "prompt": "token id 99 at index 0").
    ("completions", {"model": MODEL, "prompt": [[5, 6], [99999]]}, 400, "prompt[1]", "invalid_value"),
    ("completions", '{"model": "%s", "prompt": ["x", "a\\ud800b"]}' % MODEL, 400, "prompt[1]", None),
    # A stop string that is not valid Unicode never matches the text (it had been accepted).
    ("completions", '{"model": "%s", "prompt": "x", "stop": ["a", "\\ud83d"]}' % MODEL, 400, "stop[1]", None),
    # The wrong model is a 404 before the messages are counted.
    ("chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "1" * 5_000_000}]}, 404,
     "model", "model_not_found"),
    ("completions", {"model": MODEL, "prompt": "x", "top_k": 5}, 400, "top_k", "unsupported_parameter"),
    ("completions", {"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "invalid_value"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content[0]", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []}, 400,
     "tools", "unsupported_parameter"),
    # A neutral value of another type is not neutral (they had been taken as 1, 0 and false).
    ("completions", {"model": MODEL, "prompt": "x", "top_p": True}, 400, "top_p", "unsupported_parameter"),
    ("completions", {"model": MODEL, "prompt": "x", "presence_penalty": False}, 400, "presence_penalty",
     "unsupported_parameter"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 0}, 400, "logprobs", "unsupported_parameter"),
    ("completions", {"model": MODEL, "prompt": "x", "echo": 0}, 400, "echo", "invalid_value"),
    # Past the runtime's int32 (had hung the request and stopped the engine), or its positions.
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 2**31}, 400, "max_tokens", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens", "invalid_value"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 2**31}, 400, "max_completion_tokens", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "allowed_token_ids": [2**40]}, 400, "allowed_token_ids",
     "invalid_value"),
    # Text that is not valid Unicode (a JSON escape of a lone surrogate), JSON nested past the parser.
    ("completions", '{"model": "%s", "prompt": "a\\ud800b"}' % MODEL, 400, "prompt", None),
    ("chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}' % MODEL, 400,
     "messages[0].content", None),
    ("chat/completions", '{"model": "%s", "messages": [{"role": "system", "content": "x"}, {"role": "user", '
     '"content": [{"type": "text", "text": "y"}, {"type": "text", "text": "\\udc00"}]}]}' % MODEL, 400,
     "messages[1].content[1]", None),
    ("completions", "[" * 100_000 + "]" * 100_000, 400, None, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages[0].content[0]", None),
    # A content part that is no object, named (it had been "messages[0].content": "a valid string").
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "y"}, "x"]}]}, 400, "messages[0].content[1]", "invalid_value"),
    # No content: the template had printed "None" into the prompt (an assistant turn may have none).
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": None}]}, 400,
     "messages[0].content", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    # Python's NaN literal is not JSON (it had reached the checks as a number: "must be <= 2").
    ("completions", '{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL, 400, None, None),
    # A prompt no block fits after is the prompt's fault, not max_tokens' (a chat's: messages').
    ("completions", {"model": MODEL, "prompt": [5] * 200_000}, 400, "prompt", "invalid_value"),
    # More choices (prompts times n) than MAX_CHOICES: 128,000 had kept /health waiting 21 s.
    ("completions", {"model": MODEL, "prompt": [[5]] * (MAX_CHOICES // 128 + 1), "n": 128}, 400, "prompt",
     "invalid_value"),
    # The chat template's controls: exclusive, and not to be set through the template's variables.
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "continue_final_message": True, "add_generation_prompt": True}, 400,
     "continue_final_message", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs", "invalid_value"),
    # Tools or documents that are no lists of dicts: the template's inputs, refused as it renders
    # (not a 500), naming the variable (they had been blamed on the messages).
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"tools": "x"}}, 400, "chat_template_kwargs.tools", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"documents": [1]}}, 400, "chat_template_kwargs.documents", None),
    # A template variable that is not valid Unicode (a lone surrogate), named as such, not as a
    # place in the rendered prompt blamed on the messages.
    ("chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "x"}], '
     '"chat_template_kwargs": {"bos_token": {"a": ["\\ud800"]}}}' % MODEL, 400, "chat_template_kwargs.bos_token",
     None),
    ("completions", {"model": MODEL, "prompt": "x", "seed": -2**63 - 1}, 400, "seed", "invalid_value"),
    # Apply_chat_template's own argument "self" (a 500), and messages nested deeper than Python's
    # stack, short of the JSON parser's limit (a 500: RecursionError).
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"self": 1}}, 400, "chat_template_kwargs", "invalid_value"),
    # transformers' keywords for its tokenized output, which would reach no template.
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"max_length": 8}}, 400, "chat_template_kwargs", "invalid_value"),
    ("chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "x", "deep": %s}]}'
     % (MODEL, "[" * 900 + "]" * 900), 400, "messages", None),
    # Beyond the server's denoise steps a block (--max-denoising-steps-limit): one request of 2^31
    # steps had held its slots for as long as its client waited.
    ("completions", {"model": MODEL, "prompt": "x", "max_denoising_steps": 2**31 - 1}, 400, "max_denoising_steps",
     "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "stream_drafts": True}, 400, "stream_drafts", None),
    ("completions", '{"model": "%s", "prompt": "x", "seed": 1%s}' % (MODEL, "0" * 5000), 400, None, None),
    # user is OpenAI's string (a dict or a number had been accepted).
    ("completions", {"model": MODEL, "prompt": "x", "user": {"id": 1}}, 400, "user", "invalid_value"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "user": 5}, 400, "user",
     "invalid_value"),
])
def test_error_bodies(base_url, path, body, status, param, code):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{base_url}/v1/{path}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)


@pytest.mark.parametrize("body, says", [
    ('{"model": "%s", "prompt": "a\\ud800b"}' % MODEL, "prompt is not valid Unicode"),
    ('{"model": "%s", "prompt": "x", "seed": 1%s}' % (MODEL, "0" * 5000), "a number of 5001 digits"),
    ('{"model": "%s", "prompt": "x", "\\ud800": 1}' % MODEL, "a parameter's name is not valid Unicode"),
    # Not "(0: the model's)", which the C++ API takes and the server refuses.
    ('{"model": "%s", "prompt": "x", "canvas_length": 64}' % MODEL, "must be at most the model's canvas_length ("),
    # The request's names, not SamplingParams' (its class name had stayed in some messages).
    ('{"model": "%s", "prompt": "x", "seed_canvas": [3]}' % MODEL, "seed_canvas has 1 tokens"),
    # A prompt of the wrong shape is not "Input should be a valid string".
    ('{"model": "%s", "prompt": [5.0]}' % MODEL, "a prompt is a string or a list of token ids"),
    ('{"model": "%s", "prompt": [[5], 5]}' % MODEL, "a prompt is a string or a list of token ids"),
])
def test_error_messages_name_what_the_client_sent(base_url, body, says):
    """Not the tokenizer's "text", nor Python's advice to raise sys.set_int_max_str_digits."""
    r = httpx.post(f"{base_url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert "SamplingParams" not in r.json()["error"]["message"]


@pytest.mark.parametrize("method,path,allow", [("GET", "/v1/chat/completions", "POST"),
                                               ("POST", "/v1/models", "GET"), ("DELETE", "/v1/completions", "POST")])
def test_wrong_method(base_url, method, path, allow):
    """A 405 in OpenAI's error body, with the Allow header HTTP asks of it (it had been dropped)."""
    r = httpx.request(method, base_url + path)
    assert (r.status_code, r.headers.get("allow")) == (405, allow)
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=MODEL, prompt="x", presence_penalty=1.0)
    client.completions.create(model=MODEL, prompt="x", max_tokens=4, presence_penalty=0, top_p=1,  # no-op values
                              user="someone")


def test_null_and_no_op_parameters_are_accepted(client):
    """A parameter given as null is not given, as OpenAI takes it (the openai client sends an
    explicit None as null: n, stream, logit_bias or suffix had been refused); logit_bias {},
    best_of 1 and response_format text, which change nothing, are accepted as top_p 1 is."""
    messages = [{"role": "user", "content": "Hi"}]
    expected = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=5)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=5, n=None, stream=None,
                                         logit_bias=None, tools=None, temperature=None,
                                         response_format={"type": "text"})
    assert out.choices[0].message.content == expected.choices[0].message.content
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=5, logit_bias={}) \
        .choices[0].message.content == expected.choices[0].message.content
    client.completions.create(model=MODEL, prompt="x", max_tokens=4, suffix=None, best_of=1, logit_bias={}, echo=None)
    with pytest.raises(openai.BadRequestError, match='only {"type": "text"} is accepted'):
        client.chat.completions.create(model=MODEL, messages=messages, response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="x", best_of=2)


def test_chat_template_controls(client, offline):
    """vLLM's chat template parameters: continue_final_message (the prompt ends inside the final
    message, which the model goes on with), add_generation_prompt, and chat_template_kwargs (the
    template's own variables: this one's enable_thinking)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]

    def expected(**options):  # offline generation from the prompt transformers' options make
        text = offline.tokenizer.apply_chat_template(messages, **options)
        ids = offline.tokenizer.encode(text, add_special_tokens=False)
        return offline.generate([ids], ds.SamplingParams(max_new_tokens=8, seed=3))[0]

    for options in ({"continue_final_message": True}, {"add_generation_prompt": False},
                    {"chat_template_kwargs": {"enable_thinking": True}}, {}):
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=3, extra_body=options)
        want = expected(**options.get("chat_template_kwargs", options))
        assert out.choices[0].message.content == want.text, options
        assert out.usage.prompt_tokens == len(want.prompt_token_ids), options
    lengths = {len(expected(**options).prompt_token_ids) for options in (
        {"continue_final_message": True}, {"add_generation_prompt": False}, {"enable_thinking": True}, {})}
    assert len(lengths) == 4  # each option changed the prompt


def test_negative_seed_and_null_stream_options(client):
    """OpenAI's seed is a signed 64-bit integer: -1 is 2**64 - 1 (it had been refused); and
    stream_options' include_usage as null is not given, as at the top level."""
    def text(seed):
        return client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, seed=seed).choices[0].text

    assert text(-1) == text(2**64 - 1)
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, seed=1, stream=True,
                                            stream_options={"include_usage": None}))
    assert all(c.usage is None for c in chunks)


def test_developer_messages(client):
    """A developer message (OpenAI's newer name for system, which coding agents send) is a system
    one for a template that does not name the role: the test checkpoint's template, as Gemma's,
    had refused it. A template that names it gets it as it is."""
    def reply(role):
        return client.chat.completions.create(model=MODEL, max_tokens=8, seed=6, messages=[
            {"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}])

    developer, system = reply("developer"), reply("system")
    assert developer.choices[0].message.content == system.choices[0].message.content
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    body = parse(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "developer", "content": "x"}]})
    assert body.conversation(template_names_developer=True)[0]["role"] == "developer"


PARTS_TEMPLATE = (  # Gemma 3's way with content: a string, or a list of parts it loops over
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_json_a_template_writes_of_a_requests_data_counts_against_the_prompts_length(checkpoint, tmp_path):
    """A template that writes tools as indented JSON (Llama 3.1's tojson(indent=4)) indents each
    item of nested data by its depth: a request of 2 MB nested 300 deep had rendered 1.2 GB (3.7
    GB of memory, 14 s) before the prompt's length was checked. The JSON is counted, from its
    pieces, before it is written; tools of a usual size render as transformers renders them."""
    from fastapi.testclient import TestClient

    path = shutil.copytree(checkpoint, tmp_path / "tools")
    config = json.loads((path / "tokenizer_config.json").read_text())
    template = "{% for t in tools %}{{ t | tojson(indent=4) }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "enum": ["a", "b"]}}}}}
    messages = [{"role": "user", "content": "hi"}]
    expected = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tools=[tool], tokenize=False)
    deep = 0
    for _ in range(300):
        deep = [deep]
    engine = AsyncLLM(ds.LLM(path))
    try:
        with TestClient(build_app(engine, MODEL, max_prompt_chars=1 << 20)) as http:
            body = {"model": MODEL, "messages": messages}
            ok = http.post("/tokenize", json={**body, "chat_template_kwargs": {"tools": [tool]}})
            assert ok.status_code == 200 and ok.json()["tokens"] == engine.tokenizer.encode(expected, False)
            tracemalloc.start()
            big = http.post("/v1/chat/completions", json={**body, "max_tokens": 4, "chat_template_kwargs": {
                "tools": [{"function": {"parameters": [deep] * 200}}]}})
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    finally:
        engine.shutdown()
    assert big.status_code == 400 and "writes its data as JSON of about" in big.json()["error"]["message"], big.text
    assert peak < 16 << 20, peak  # (the JSON itself: 200 x 300 x 301 x 2 spaces, 36 MB)


def test_content_parts_reach_a_template_that_loops_over_them_as_a_list(checkpoint, tmp_path):
    """Text parts go to a template that loops over content parts (Gemma's) as the list the client
    sent, as vLLM passes them, so the prompt is transformers' for those messages (they had been
    joined by newlines, as they still are for a template that takes strings only)."""
    from fastapi.testclient import TestClient

    from diffuserve.chat_template import loops_over_content

    assert loops_over_content(PARTS_TEMPLATE)
    assert loops_over_content("{% set rest = messages[1:] %}{% for m in rest | reverse %}"
                              "{% for p in m.content | selectattr('text') %}{% endfor %}{% endfor %}")
    # As vLLM reads templates: a message is a loop's over the messages, its content looped over
    # directly (the parts had gone as a list to templates that print a message's content whole).
    assert not loops_over_content(CHAT_TEMPLATE) and not loops_over_content("{% for x in y %}")
    hits = loops_over_content.cache_info().hits  # every chat request asks: a template is parsed once
    assert loops_over_content(PARTS_TEMPLATE) and loops_over_content.cache_info().hits == hits + 1
    for other in ("{% for i in range(messages | length) %}{% for p in messages[i]['content'] %}{% endfor %}"
                  "{% endfor %}",
                  "{% for t in tools %}{% for x in t.content %}{% endfor %}{% endfor %}",
                  "{% macro parts(turn) %}{% for p in turn.content %}{% endfor %}{% endmacro %}"
                  "{% for m in messages %}{{ parts(m) }}{% endfor %}",
                  "{% set ns = namespace() %}{% set ns.m = messages %}"
                  "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}"):
        assert not loops_over_content(other), other
    path = shutil.copytree(checkpoint, tmp_path / "parts")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": PARTS_TEMPLATE}))
    parts = [{"type": "text", "text": " Describe"}, {"type": "text", "text": "this. "}]
    messages = [{"role": "user", "content": parts}]
    text = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "Describethis." in text
    llm = ds.LLM(path, kv_cache_memory_bytes=32 << 20)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    want = llm.generate([ids], ds.SamplingParams(max_new_tokens=8, seed=5))[0]
    with TestClient(build_app(AsyncLLM(llm), MODEL)) as http:
        reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8,
                                                        "seed": 5}).json()
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["choices"][0]["message"]["content"] == want.text
    joined = parse(ChatCompletionRequest, {"model": MODEL, "messages": messages}).conversation()
    assert joined[0]["content"] == " Describe\nthis. "


def test_stream_chunks_stay_one_line_whatever_the_text():
    """Text holding U+0085, U+2028 or U+2029 (which JSON leaves raw, and line readers such as
    httpx's iter_lines end a line at): the chunk's JSON escapes them, one line (a client
    reading lines had got half a chunk's JSON)."""
    text = "a\x85b\u2028c\u2029d\x0be\x1cf\u00e9\n"
    event = server_module._sse({"choices": [{"text": text}]}, False)
    assert event.startswith("data: ") and event.endswith("\n\n")
    line = event[len("data: "):-2]
    assert line.splitlines() == [line] and json.loads(line) == {"choices": [{"text": text}]}


def test_tool_call_arguments_reach_the_template_as_objects():
    """An assistant's tool calls carry their arguments as JSON text (OpenAI's format); the
    template gets the object, as vLLM passes it (a template iterating them had met a string);
    none or "" is {}, and text that is not JSON is a 400 naming the call."""
    def call(arguments):
        return {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}

    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [call('{"a": [1, 2]}'), call(""), call(None), call({"b": 1})]},
                {"role": "tool", "content": "3", "tool_call_id": "c"}]
    body = parse(ChatCompletionRequest, {"model": MODEL, "messages": messages})
    calls = body.conversation()[1]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [{"a": [1, 2]}, {}, {}, {"b": 1}]
    assert calls[0]["id"] == "c" and calls[0]["function"]["name"] == "f"
    messages[1]["tool_calls"].append(None)
    for arguments, message in [("{not json", "not valid JSON"), ('{"a": NaN}', "NaN is not a JSON value"),
                               ("[" * 100_000, "nested too deeply")]:
        messages[1]["tool_calls"][-1] = call(arguments)
        with pytest.raises(ApiError, match=f"a tool call's arguments .*{message}") as error:
            parse(ChatCompletionRequest, {"model": MODEL, "messages": messages}).conversation()
        assert error.value.status == 400 and error.value.param == "messages[1].tool_calls[4].function.arguments"


@pytest.mark.parametrize("message,param,error", [
    ({"role": "assistant", "tool_calls": "x"}, "messages[1].tool_calls", "must be a list of tool calls, got str"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}, "messages[1].tool_calls[0]",
     'whose "function" is an object with a string "name"'),
    ({"role": "assistant", "tool_calls": [{"function": {"name": 3, "arguments": "{}"}}]},
     "messages[1].tool_calls[0]", 'whose "function" is an object with a string "name"'),
    ({"role": "user", "content": "y", "tool_calls": []}, "messages[1].tool_calls",
     "a user message has no tool_calls"),
])
def test_tool_calls_not_shaped_as_openais_are_named(message, param, error):
    """tool_calls other than OpenAI's list of calls, each naming its function, are a 400 naming
    them: a string had reached the template, which iterated its characters."""
    body = parse(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "x"}, message]})
    with pytest.raises(ApiError, match=re.escape(error)) as raised:
        body.conversation()
    assert raised.value.status == 400 and raised.value.param == param


@pytest.mark.parametrize("path,value", [("completions", 1), ("chat/completions", True)])
def test_logprobs_are_refused_as_not_returned(base_url, path, value):
    """Legacy completions' logprobs is a count, chat's a bool: the refusal says none are
    returned (it had told a completions client that only false, no count, is accepted)."""
    body = {"model": MODEL, "logprobs": value,
            **({"prompt": "x"} if path == "completions" else {"messages": [{"role": "user", "content": "x"}]})}
    r = httpx.post(f"{base_url}/v1/{path}", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert r.json()["error"]["message"] == "unsupported parameter: 'logprobs' (log-probabilities are not returned)"


@pytest.mark.parametrize("param", ["tools", "tool_choice"])
def test_tools_are_refused_saying_where_a_template_takes_them(base_url, param):
    """OpenAI's tools and tool_choice are refused (no parser makes tool_calls of the model's
    text), saying that a template renders tools given as chat_template_kwargs.tools."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], param: tools if param == "tools" else "auto"}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert r.json()["error"]["message"] == (f"unsupported parameter: '{param}' (no parser turns the model's text into "
                                            "tool_calls; a chat template that renders tools takes them as "
                                            "chat_template_kwargs.tools)")


def test_request_translation_into_sampling_params():
    """Without max_tokens a request takes the checkpoint's length (generation_config.json's), or
    where it gives none the whole context, cut to the whole blocks the context has room for
    (vLLM's rule: a long prompt had been refused for a max_tokens its client never sent, and
    replies cut at the runtime's default 256 tokens); allowed_token_ids go once each (a million
    copies times n had taken minutes)."""
    defaults = {"t_min": 0.4, "t_max": 0.8, "length_given": True, "context": 4096, "eos_token_ids": [1],
                "vocab_size": 512}
    body = parse(CompletionRequest, {"model": MODEL, "prompt": "x", "n": 2, "allowed_token_ids": [7, 5, 7] * 1000})
    for length_given, max_tokens, expected, fit in ((True, None, None, True), (False, None, 4096, True),
                                                    (False, 16, 16, False)):
        params = body.sampling_params({**defaults, "length_given": length_given}, max_tokens, 1024)
        assert [(p.max_new_tokens, p.fit_to_context, p.allowed_token_ids) for p in params] == \
            [(expected, fit, [5, 7])] * 2


def test_vllm_extras_at_their_defaults_and_both_length_names():
    """Clients written for vLLM send its sampling extras at their defaults (top_k -1 or 0, min_p 0,
    repetition_penalty 1, ...), top_logprobs 0 and more than OpenAI's 4 stop strings: accepted (had
    been 400s). Given both, max_completion_tokens wins, as in vLLM (had been a 400)."""
    extras = {"top_k": -1, "min_p": 0, "repetition_penalty": 1, "min_tokens": 0,
              "skip_special_tokens": True, "spaces_between_special_tokens": True,
              "top_logprobs": 0, "stop": [str(i) for i in range(10)]}
    parse(CompletionRequest, {"model": MODEL, "prompt": "x", **extras})
    parse(CompletionRequest, {"model": MODEL, "prompt": "x", "top_k": 0})
    chat = parse(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                         "max_tokens": 8, "max_completion_tokens": 16})
    assert chat.max_new_tokens() == 16


@pytest.mark.parametrize("request_type, body, message", [
    # (pydantic's "a valid dictionary or instance of ChatMessage" had named a class of ours)
    (ChatCompletionRequest, {"messages": ["hi"]}, "invalid value for 'messages[0]': must be a JSON object"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "stream_options": 5},
     "invalid value for 'stream_options': must be a JSON object"),
    # (a validator's own words had come after pydantic's "Value error, ")
    (CompletionRequest, {"prompt": "x", "echo": True}, "invalid value for 'echo': only false is supported"),
])
def test_invalid_values_are_worded_for_the_client(request_type, body, message):
    with pytest.raises(ApiError) as e:
        parse(request_type, {"model": MODEL, **body})
    assert str(e.value) == message


MANY = 200_000


@pytest.mark.parametrize("request_type, body, message", [
    (CompletionRequest, {"prompt": [[[]] * MANY]}, "invalid value for 'prompt'"),
    (CompletionRequest, {"prompt": [[5]] * MANY}, "a request may ask for at most 4096 choices"),
    (CompletionRequest, {"prompt": [5], "allowed_token_ids": [[]] * MANY},
     "invalid value for 'allowed_token_ids[0]': Input should be a valid integer"),
    (CompletionRequest, {"prompt": [5], "stop": [[]] * MANY}, "stop may hold at most 256 strings"),
    (CompletionRequest, {"prompt": [5], **{f"x{i}": 0 for i in range(MANY)}}, "unsupported parameter: 'x0'"),
    (CompletionRequest, {"prompt": [5], "stream_options": {f"x{i}": 0 for i in range(MANY)}},
     "unsupported parameter: 'stream_options.x0'"),
    (ChatCompletionRequest, {"messages": [{"role": "x"}] * MANY}, "invalid value for 'messages[0].role'"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [5] * MANY}]},
     "invalid value for 'messages[0].content"),
    (server_module.DetokenizeRequest, {"tokens": ["5"] * MANY}, "invalid value for 'tokens[0]'"),
    # (Set aside, a long list is refused after the rest: the first unsupported parameter still comes first.)
    (CompletionRequest, {"prompt": [[5]] * MANY, "logprobs": 3}, "unsupported parameter: 'logprobs'"),
    (CompletionRequest, {"prompt": [5], "stop": ["a"] * MANY, "x": 3}, "unsupported parameter: 'x'"),
    (CompletionRequest, {"prompt": [0.5] * MANY}, "invalid value for 'prompt': a prompt is a string or a list of "
                                                "token ids"),  # (one prompt, no batch)
], ids=["nested prompts", "prompts", "ids", "stop", "names", "stream_options", "messages", "parts", "detokenize",
        "prompts and a parameter", "stop and a parameter", "float ids"])
def test_a_body_of_many_items_is_refused_at_its_first_bad_one(request_type, body, message):
    """A list is read up to its first bad item, a batch's or stop's length and unknown names
    counted before their items are read: pydantic had described every bad item (2 million in a
    10 MiB body: 58 s and 8.5 GB), and built every good one of a batch it then refused (15
    million one-id prompts: 100 s and 6.8 GB), holding the event loop's GIL throughout. (Python's
    allocations as the measure, not time: here 770-1,300 bytes an item before, under 160 now.)"""
    tracemalloc.start()
    try:
        with pytest.raises(ApiError, match=re.escape(message)):
            parse(request_type, {"model": MODEL, **body})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 160 * MANY, peak  # (the names: a copy of the body without its nulls, 100 bytes a name)


@pytest.mark.parametrize("encoding", ["gzip", "deflate, gzip"])
def test_compressed_bodies_are_refused(base_url, encoding):
    """A body with a Content-Encoding is refused naming it: a gzip body had been parsed as it
    came ("not valid JSON: 'utf-8' codec can't decode byte 0x8b"), a plain one labelled gzip
    taken as it was."""
    plain = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4}).encode()
    for content in (gzip.compress(plain), plain):
        r = httpx.post(base_url + "/v1/completions", content=content,
                       headers={"content-type": "application/json", "content-encoding": encoding})
        assert r.status_code == 415, r.text
        assert repr(encoding) in r.json()["error"]["message"]
    r = httpx.post(base_url + "/v1/completions", content=plain,
                   headers={"content-type": "application/json", "content-encoding": "identity"})
    assert r.status_code == 200, r.text


def pieces(response) -> list:
    """A stream's chunks without their ids and times."""
    return [{k: v for k, v in json.loads(line[6:]).items() if k not in ("id", "created")}
            for line in response.text.splitlines() if line.startswith("data: {")]


def test_vllms_continuous_usage_stats_is_taken_at_false(base_url):
    """stream_options.continuous_usage_stats, which clients written for vLLM send: false streams
    as without it (it had been refused as an unknown parameter), and so does true without
    include_usage, as in vLLM."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True, "seed": 0}
    plain = httpx.post(base_url + "/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    r = httpx.post(base_url + "/v1/completions",
                   json={**body, "stream_options": {"include_usage": True, "continuous_usage_stats": False}})
    assert r.status_code == 200 and plain.status_code == 200
    assert pieces(r) == pieces(plain)
    unasked = httpx.post(base_url + "/v1/completions", json={**body, "stream_options": {"continuous_usage_stats": True}})
    assert pieces(unasked) == pieces(httpx.post(base_url + "/v1/completions", json=body))


@pytest.mark.parametrize("path, prompt", [("/v1/completions", {"prompt": ["Hello", "Hi there"]}),
                                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_vllms_continuous_usage_stats_give_each_chunk_its_choices_usage(base_url, path, prompt):
    """With include_usage, continuous_usage_stats (vLLM's) puts in every chunk the usage of its
    choice so far: its prompt's tokens and the tokens given out, which end at the choice's
    share of the final usage; the rest of the stream is as without it."""
    with httpx.Client(base_url=base_url) as http:
        check_continuous_usage(http, path, {**prompt, "n": 2, "seed": 0})


def test_continuous_usage_stats_count_to_a_stop_string(tmp_path):
    """Where a stop string ends a choice, each chunk's count is of the tokens whose text went
    out: a block's tokens whose text was held back (a byte-fallback tokenizer's partial
    characters) had been counted past the stop (16 in the last chunk, 4 in the final usage)."""
    from fastapi.testclient import TestClient

    engine = AsyncLLM(ds.LLM(write_chat_checkpoint(tmp_path / "m", byte_fallback=True)))
    try:
        with TestClient(build_app(engine, MODEL)) as http:
            for seed in range(12, 20):
                for stop in ([" "], ["e"], ["a", "o"]):
                    check_continuous_usage(http, "/v1/completions", {"prompt": "Hello", "stop": stop, "seed": seed,
                                                                     "n": 2})
    finally:
        engine.shutdown()


def check_continuous_usage(http, path, request):
    body = {"model": MODEL, "max_tokens": 24, "stream": True, **request, "stream_options": {"include_usage": True}}
    plain = pieces(http.post(path, json=body))
    chunks = pieces(http.post(path, json={**body, "stream_options": {"include_usage": True,
                                                                      "continuous_usage_stats": True}}))
    final = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and final == plain[-1]["usage"]

    def by_choice(stream):  # (the choices' chunks interleave as their blocks come)
        return sorted(([{k: v for k, v in c.items() if k != "usage"} for c in stream[:-1]]),
                      key=lambda c: c["choices"][0]["index"])
    assert by_choice(chunks) == by_choice(plain)
    last = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] >= last.get(choice["index"], {"completion_tokens": 0})["completion_tokens"]
        last[choice["index"]] = usage
    n = request.get("n", 1)
    assert len(last) == n * (len(request["prompt"]) if isinstance(request.get("prompt"), list) else 1)
    assert sum(u["completion_tokens"] for u in last.values()) == final["completion_tokens"]
    assert sum(u["prompt_tokens"] for i, u in last.items() if i % n == 0) == final["prompt_tokens"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_bodies_labelled_other_than_json_are_refused(base_url, path):
    """A body whose Content-Type is not JSON (text/plain, which a browser's page may send to any
    server without a preflight, or a form's) is a 415 naming it, as vLLM refuses it: such
    requests had run. One labelled application/json, a +json type, or nothing is read."""
    body = {"model": MODEL, **({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}),
            **({"max_tokens": 4} if path.startswith("/v1") else {})}
    content = json.dumps(body).encode()
    for label in ("text/plain", "application/x-www-form-urlencoded", "text/json"):
        r = httpx.post(base_url + path, content=content, headers={"content-type": label})
        assert r.status_code == 415, r.text
        assert r.json()["error"]["message"] == (f"the request body's Content-Type {label!r} is not JSON: send the body "
                                                "as application/json")
    for label in ("application/json; charset=utf-8", "application/vnd.api+json", None):
        r = httpx.post(base_url + path, content=content, headers={"content-type": label} if label else {})
        assert r.status_code == 200, (label, r.text)


class _Client:
    """A request's client, as run() reads it (it listens for the disconnect while the choices
    start): it leaves once `leaves()` (at once by default), its first ASGI message then the
    disconnect; until then none comes."""
    def __init__(self, leaves=lambda: True):
        self.leaves = leaves

    async def receive(self):
        while not self.leaves():
            await asyncio.sleep(0.001)
        return {"type": "http.disconnect"}


def test_many_choices_are_started_in_turns_of_the_event_loop(checkpoint, monkeypatch):
    """A request's choices ask the engine a group at a time, the event loop serving other
    requests between: all in one turn, 128,000 choices had kept /health waiting 21 s. Its
    stream closed, every choice is aborted and the KV freed."""
    engine = AsyncLLM(ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20))
    server = server_module._Server(engine, MODEL)
    turns, ticks = [], [0]
    real_start = server_module._Choice.start

    async def start(choice):
        turns.append(ticks[0])  # the turn of the loop in which the choice asks the engine
        await real_start(choice)

    monkeypatch.setattr(server_module._Choice, "start", start)

    async def main():
        async def ticker():  # counts the turns of the event loop
            while True:
                await asyncio.sleep(0)
                ticks[0] += 1

        counting = asyncio.create_task(ticker())
        body = parse(CompletionRequest, {"model": MODEL, "prompt": [[5, 6]] * 8, "n": 128, "max_tokens": 16,
                                         "stream": True})
        response = await server.run(_Client(leaves=lambda: False), body, [[5, 6]] * 8, 16, server_module._Format(MODEL, chat=False))
        await response.body_iterator.__anext__()  # a block has finished
        await response.body_iterator.aclose()  # the client leaves: every choice is cancelled
        counting.cancel()

    try:
        asyncio.run(main())
        assert len(turns) == 8 * 128 and len(set(turns)) > 1, set(turns)
        wait_until_idle(engine, 30)
    finally:
        engine.shutdown()


def test_a_client_that_leaves_while_its_choices_start_ends_the_starts(checkpoint, monkeypatch):
    """A request of many choices takes several of the engine's turns to start (it takes new
    requests between its steps): a client that had left meanwhile had them all started, and
    hundreds run, before its disconnect was read. Now the starts end within a turn or two of
    the event loop, and the choices the engine took count as aborted in /metrics."""
    engine = AsyncLLM(ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20))
    server = server_module._Server(engine, MODEL)
    asked, taken = [], []
    real_start = server_module._Choice.start

    async def start(choice):
        asked.append(choice)
        await real_start(choice)
        taken.append(choice)  # the engine has it

    monkeypatch.setattr(server_module._Choice, "start", start)
    body = parse(CompletionRequest, {"model": MODEL, "prompt": [[5, 6]] * 8, "n": 128, "max_tokens": 2000,
                                     "ignore_eos": True})

    def aborted():
        text = server.metrics.exposition().decode()
        return float(re.search(r'diffuserve_requests_total\{finish_reason="abort"\} (\S+)', text).group(1))

    def run(request):
        with pytest.raises(ApiError, match="the client closed the request"):
            asyncio.run(server.run(request, body, [[5, 6]] * 8, 2000, server_module._Format(MODEL, chat=False)))
        wait_until_idle(engine, 30)

    try:
        run(_Client())
        # A few of the event loop's turns (128 starts each) until the disconnect is read: all
        # 1,024 had started.
        assert 0 < len(asked) <= 4 * 128, len(asked)
        assert aborted() == len(taken)  # (the engine took none of them before they were cancelled)
        before, taken_before = aborted(), len(taken)
        run(_Client(leaves=lambda: len(taken) > taken_before))  # once the engine has taken some
        assert aborted() - before >= 1
    finally:
        engine.shutdown()


def test_requests_left_before_the_engine_took_them_are_never_added(checkpoint):
    """Callers that leave while their adds still wait in the engine thread's queue (behind a
    step, or a burst of other adds) cost the engine nothing: their adds are passed over, where
    they had been admitted and run until the aborts queued behind them came through."""
    llm = ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20)
    added = []
    add_request = llm.add_request
    llm.add_request = lambda *args: (added.append(1), add_request(*args))[1]
    engine = AsyncLLM(llm)
    params = ds.SamplingParams(max_new_tokens=8, seed=0)

    async def main():
        async def first_update(updates):
            return await updates.__anext__()

        with llm._lock:  # the engine thread waits to read the queue
            tasks = [asyncio.create_task(first_update(engine.generate([5, 6], params))) for _ in range(50)]
            await asyncio.sleep(0.05)  # each has queued its add
            for task in tasks:
                task.cancel()  # the caller leaves: its abort queued behind the add
            await asyncio.gather(*tasks, return_exceptions=True)
        kept = engine.generate([5, 6], params)  # after them: taken and run as ever
        return [p async for p in kept][-1].output

    try:
        output = asyncio.run(main())
        assert output.finish_reason == "length" and len(output.token_ids) == 8
        # (The first add may have been read as the lock was taken: that one waits for it.)
        assert len(added) <= 2 and not engine._engine.left, len(added)
        wait_until_idle(engine, 30)
    finally:
        engine.shutdown()


def test_failed_request_counts_as_error(checkpoint, tmp_path, caplog):
    """A request the model cannot finish (its logits NaN) gets a 503, and /metrics counts it
    under finish_reason "error", apart from the clients' aborts (it had counted as "abort"). The
    log names it by its id (the client's X-Request-Id) with the reason, streamed or not (nothing
    had been logged but uvicorn's access line, a streamed one's "200 OK")."""
    from fastapi.testclient import TestClient
    from safetensors.numpy import load_file

    from diffuserve.safetensors_io import write_safetensors

    path = shutil.copytree(checkpoint, tmp_path / "nan")
    tensors = load_file(path / "model.safetensors")
    embedding = next(name for name in tensors if name.endswith("embed_tokens.weight"))
    tensors[embedding][7] = np.nan  # token 7's embedding, and the tied lm_head's logit 7: NaN
    write_safetensors(path / "model.safetensors", tensors)
    with TestClient(build_app(AsyncLLM(ds.LLM(path)), MODEL)) as http:
        request = {"model": MODEL, "prompt": [7, 8], "max_tokens": 8, "seed": 0, "n": 2}
        with caplog.at_level(logging.INFO, logger="diffuserve"):
            assert http.post("/v1/completions", json=request, headers={"X-Request-Id": "failing-1"}).status_code \
                == 503
            text = http.get("/metrics").text
            with http.stream("POST", "/v1/completions", json={**request, "n": 1, "stream": True},
                             headers={"X-Request-Id": "failing-2"}) as response:
                assert response.status_code == 200 and "logits" in "".join(response.iter_lines())
    assert 'diffuserve_requests_total{finish_reason="error"} 2.0' in text  # both choices: the request failed
    assert 'diffuserve_requests_total{finish_reason="abort"} 0.0' in text
    for request_id in ("cmpl-failing-1", "cmpl-failing-2"):
        assert re.search(request_id + r" failed: .*logits", caplog.text), caplog.text


def test_serve_logs_aborts_by_request_id_and_its_access_log_may_be_off(checkpoint):
    """A client that leaves a plain request is logged, by the id it sent as X-Request-Id (the
    499 goes to a closed connection, which uvicorn does not log: nothing had been), which is
    the response's id too, as in vLLM; --disable-uvicorn-access-log (vLLM's) drops the line a
    response, and the package's own lines go through uvicorn's handler (they had been bare)."""
    proc, port = _serve_process(checkpoint, "--log-level", "info", "--disable-uvicorn-access-log",
                                stdout=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        done = httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 4},
                          headers={"X-Request-Id": "mine-1"})
        assert done.json()["id"] == "cmpl-mine-1"
        long = {"model": MODEL, "prompt": "long", "max_tokens": 2048, "confidence_threshold": 1e-30,
                "max_denoising_steps": 1024, "seed": 0, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url, json=long, headers={"X-Request-Id": "mine-2"}, timeout=httpx.Timeout(5, read=0.5))
        with httpx.stream("POST", url, json={**long, "stream": True, "stream_drafts": True},
                          headers={"X-Request-Id": "mine-3"}) as response:
            next(response.iter_lines())  # the first draft: then the client leaves
        time.sleep(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = (stream.decode() for stream in proc.communicate(timeout=60))
    assert "INFO:     cmpl-mine-2 aborted: the client left" in stderr, stderr
    assert "INFO:     cmpl-mine-3 aborted: the client left" in stderr, stderr
    assert "POST /v1/completions" not in stdout + stderr


def test_a_stream_that_fails_inside_the_server_ends_as_a_stream(offline, monkeypatch, caplog):
    """An exception of the server's own (not the engine's) while a stream runs: the client
    gets an error event and [DONE], and the log the traceback (the connection had been cut
    off mid-response, an incomplete chunked read); the next request is served."""
    from fastapi.testclient import TestClient

    events = server_module._Choice.events

    async def failing(self):
        async for event in events(self):
            yield event
            if self.prompt[-1] == 9:
                raise RuntimeError("a bug in the server")

    monkeypatch.setattr(server_module._Choice, "events", failing)
    engine = AsyncLLM(offline)
    try:
        with TestClient(build_app(engine, MODEL)) as http:
            request = {"model": MODEL, "prompt": [5, 9], "max_tokens": 40, "seed": 0, "stream": True}
            with http.stream("POST", "/v1/completions", json=request) as response:
                lines = [line for line in response.iter_lines() if line]
            assert response.status_code == 200 and lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2].removeprefix("data: ")) == {"error": {
                "message": "internal server error (the server's log has its details)", "type": "server_error",
                "param": None, "code": None}}
            assert "RuntimeError: a bug in the server" in caplog.text
            ok = http.post("/v1/completions", json={**request, "prompt": [5, 8], "stream": False})
            assert ok.status_code == 200
    finally:
        engine.shutdown()


def test_health_fails_once_the_engine_has(offline):
    """/health answers 503 once the engine thread has failed (it had kept answering 200 while
    every request got a 503), and /metrics counts each choice refused then as an error (none
    had been: only a request running when the engine failed was)."""
    from fastapi.testclient import TestClient

    class FailingLLM:  # an engine whose step fails as a bug in it would, with work always waiting
        tokenizer, model = offline.tokenizer, offline.model
        _lock, _held = threading.RLock(), []
        scheduler = types.SimpleNamespace(has_unfinished=lambda: True)

        def stats(self):
            return offline.stats()

        def _step_for(self, claimant):  # (AsyncLLM's step)
            raise RuntimeError("a bug in the engine")

        def interrupt(self):
            pass

    engine = AsyncLLM(FailingLLM())
    deadline = time.monotonic() + 30
    while engine.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    with TestClient(build_app(engine, MODEL)) as http:
        assert http.get("/health").status_code == http.get("/ping").status_code == 503
        for _ in range(3):
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": [7, 8], "max_tokens": 4, "n": 2})
            assert response.status_code == 503 and "the engine has stopped" in response.text, response.text
        text = http.get("/metrics").text
    assert 'diffuserve_requests_total{finish_reason="error"} 6.0' in text
    assert "diffuserve_prompt_tokens_total 6.0" in text  # each request's prompt, once for its two choices


def test_a_refused_request_does_not_cut_the_running_step_short(checkpoint):
    """A request the engine refuses (a token id past the vocabulary) runs in no step: it does
    not interrupt the others' (it had, each one cutting a slice of passes short); a running
    request whose client leaves does."""
    llm = ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20)
    interrupts = []
    interrupt = llm.interrupt
    llm.interrupt = lambda: (interrupts.append(1), interrupt())
    engine = AsyncLLM(llm)
    params = ds.SamplingParams(max_new_tokens=8, seed=0)

    async def refused():
        with pytest.raises(ValueError, match="out of range"):
            async for _ in engine.generate([5, 10**6], params):
                pass

    async def left_early():
        updates = engine.generate([5, 6], ds.SamplingParams(max_new_tokens=512, seed=0))
        await updates.__anext__()  # accepted
        await updates.aclose()

    try:
        asyncio.run(refused())
        assert not interrupts
        asyncio.run(left_early())
        assert len(interrupts) == 1
    finally:
        engine.shutdown()


def test_a_request_taken_but_not_yet_read_cuts_the_step_short_when_its_caller_leaves(checkpoint):
    """A caller that leaves after the engine took its request, before reading that it did,
    interrupts the running step as one that read it does (it had waited for the whole step,
    the KV held and the batch kept waiting)."""
    llm = ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20)
    interrupts = []
    interrupt = llm.interrupt
    llm.interrupt = lambda: (interrupts.append(1), interrupt())
    engine = AsyncLLM(llm)

    async def left_before_reading():
        first = asyncio.ensure_future(engine.generate([5, 6], ds.SamplingParams(max_new_tokens=512, seed=0))
                                      .__anext__())
        await asyncio.sleep(0)  # the add is queued
        deadline = time.monotonic() + 30
        while not engine.stats["running"] + engine.stats["waiting"]:  # taken (the loop blocked: not read)
            assert time.monotonic() < deadline
            time.sleep(0.001)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)

    try:
        asyncio.run(left_before_reading())
        assert len(interrupts) == 1
        wait_until_idle(engine, 30)
    finally:
        engine.shutdown()


def test_a_request_keeps_its_prompt_and_params_as_they_were_given(checkpoint):
    """The engine thread reads a request's prompt and SamplingParams after generate() has
    queued it: a caller reusing its objects then does not change the request (it had run with
    the new seed, length and prompt)."""
    llm = ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20)
    expected = llm.generate([[5, 6, 7]], ds.SamplingParams(max_new_tokens=16, seed=1, eos_token_id=[]))[0]
    engine = AsyncLLM(llm)
    prompt, params = [5, 6, 7], ds.SamplingParams(max_new_tokens=16, seed=1, eos_token_id=[])

    async def reused():
        updates = engine.generate(prompt, params)
        with llm._lock:  # the engine thread's add waits inside add_request, holding the caller's objects
            first = asyncio.ensure_future(updates.__anext__())
            await asyncio.sleep(0.05)
            prompt[0], params.seed, params.max_new_tokens, params.eos_token_id[:] = 9, 2, 4, [5]
        await first
        async for progress in updates:
            if progress.output is not None:
                return progress.output

    async def run(prompt, params):
        return (await stream_to_the_end(engine, prompt, params)).token_ids

    try:
        output = asyncio.run(reused())
        assert (output.token_ids, output.seed) == (expected.token_ids, 1)
        # Ids in any container are copied (an array's had been read as the caller later left
        # it), and an iterator is read once, into the caller's params too, which requests share.
        prompt = array.array("i", [5, 6, 7])
        params = ds.SamplingParams(max_new_tokens=16, seed=1, eos_token_id=[])
        params.allowed_token_ids = iter(range(5, 300))
        allowed = ds.SamplingParams(max_new_tokens=16, seed=1, eos_token_id=[], allowed_token_ids=range(5, 300))
        expected = llm.generate([[5, 6, 7]], allowed)[0].token_ids

        async def shared():
            first = asyncio.ensure_future(run(prompt, params))
            await asyncio.sleep(0)
            prompt[0] = 9
            return [await first, await run([5, 6, 7], params)]

        assert asyncio.run(shared()) == [expected, expected]
        # What add_request takes, generate takes alike (a deep copy had refused dict views and
        # memoryviews), and what it refuses, generate refuses alike.
        views = ds.SamplingParams(max_new_tokens=16, seed=1, eos_token_id={}.keys(),
                                  allowed_token_ids={i: i for i in range(5, 300)}.values())
        assert asyncio.run(run(memoryview(array.array("i", [5, 6, 7])), views)) == expected
        with pytest.raises(ValueError, match=r"prompt: token ids must be a sequence \(a list or an array\), got an "
                                             r"iterator \(generator\): make it a list"):
            asyncio.run(run((i for i in [5, 6, 7]), params))
    finally:
        engine.shutdown()


def test_an_async_llm_dropped_without_shutdown_is_freed(checkpoint):
    """An AsyncLLM dropped without shutdown() stops its thread, and its LLM (the model, the KV
    cache) is freed: the thread had held both until the process exited."""
    import gc
    import weakref
    llm = ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20)
    engine = AsyncLLM(llm)
    thread, freed = engine._engine.thread, weakref.ref(llm)
    del engine, llm
    gc.collect()
    thread.join(30)
    assert not thread.is_alive()
    gc.collect()
    assert freed() is None


def test_max_prompt_chars(checkpoint):
    """--max-prompt-chars sets the longest prompt text taken before encoding; 0 takes any."""
    from fastapi.testclient import TestClient
    for limit in (10, 0):
        llm = ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20)
        with TestClient(build_app(AsyncLLM(llm), MODEL, max_prompt_chars=limit)) as http:
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ab " * 4, "max_tokens": 8})
            if limit:
                assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
                assert "12 characters of text, more than this server takes (10, --max-prompt-chars" in \
                    r.json()["error"]["message"], r.text
            else:
                assert r.status_code == 200, r.text
            assert http.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 8}).status_code \
                == 200
            # Chat messages' text is counted before the request is validated and rendered (which
            # 400,000 messages kept from every other request for 6 s): here, not their bad roles.
            messages = [{"role": "bogus", "content": "ab"}] * 4 + [{"role": "bogus", "content": [
                {"type": "text", "text": "ab"}, {"type": "text", "text": "ab"}]}]
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8})
            assert r.status_code == 400, r.text
            if limit:
                assert r.json()["error"]["param"] == "messages", r.text
                assert "12 characters of text, more than this server takes" in r.json()["error"]["message"], r.text
            else:
                assert r.json()["error"]["param"] == "messages[0].role", r.text
            # Empty ones count too: more messages than a prompt has tokens (a turn's markup is one).
            messages = [{"role": "bogus", "content": ""}] * (llm.model.max_sequence_tokens + 1)
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert "messages, more than a prompt of this model has tokens" in r.json()["error"]["message"], r.text
            # So do a message's content parts (two million empty ones had kept /health waiting 2.7 s).
            parts = [{"type": "text", "text": ""}] * (llm.model.max_sequence_tokens // 2 + 1)
            messages = [{"role": "user", "content": parts}] * 2
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert f"{len(parts) * 2} content parts, more than a prompt of this model has tokens" in \
                r.json()["error"]["message"], r.text


def test_tokenize_and_detokenize_as_vllm(client, base_url, offline):
    """vLLM's /tokenize: a text's ids (with the tokenizer's special tokens unless told not to),
    or a conversation's as chat completions run it (its count their usage's prompt_tokens),
    with max_model_len and, when asked, the tokens' strings; /detokenize: ids to text, special
    tokens kept, so that a round trip gives the text back."""
    tokenizer = offline.tokenizer
    r = httpx.post(base_url + "/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode("Hello world")
    card = httpx.get(base_url + "/v1/models").json()["data"][0]
    assert r.json() == {"count": len(ids), "max_model_len": card["max_model_len"], "tokens": ids,
                        "token_strs": [tokenizer._tokenizer.id_to_token(i) for i in ids]}
    bare = httpx.post(base_url + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False) != ids
    assert bare["token_strs"] is None
    back = httpx.post(base_url + "/detokenize", json={"model": MODEL, "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert httpx.post(base_url + "/tokenize", json={"prompt": back.json()["prompt"], "add_special_tokens": False}
                      ).json()["tokens"] == ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = httpx.post(base_url + "/tokenize", json={"model": MODEL, "messages": messages}).json()
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=0)
    assert chat["count"] == len(chat["tokens"]) == out.usage.prompt_tokens
    assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                              add_special_tokens=False)
    refusals = [("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
                ("/tokenize", {"prompt": "a", "extra": 1}, 400, "extra"),
                ("/tokenize", {"prompt": ["a"]}, 400, "prompt"),
                ("/tokenize", {"messages": []}, 400, "messages"),
                ("/tokenize", {"messages": messages, "add_generation_prompt": True, "continue_final_message": True},
                 400, "continue_final_message"),
                ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
                # an id of the model's past the tokenizer's (a padded embedding's): it had been a 500
                ("/detokenize", {"tokens": [tokenizer.vocab_size]}, 400, "tokens"),
                ("/detokenize", {"tokens": "12"}, 400, "tokens")]
    assert tokenizer.vocab_size < offline.model.vocab_size
    assert httpx.post(base_url + "/tokenize", json={"prompt": "a", "messages": None}).json()["tokens"] == \
        tokenizer.encode("a")  # (null: not given, as everywhere)
    for path, body, status, param in refusals:
        r = httpx.post(base_url + path, json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, body, r.text)


def test_api_key(offline):
    from fastapi.testclient import TestClient
    with TestClient(build_app(AsyncLLM(offline), MODEL, api_key="secret")) as http:  # exiting stops the engine
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).json()["error"]["code"] == \
            "invalid_api_key"
        assert http.get("/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200
        # The scheme is case-insensitive (RFC 7235); a refusal says which scheme it wants.
        assert http.get("/v1/models", headers={"Authorization": "bearer  secret"}).status_code == 200
        assert http.get("/v1/models", headers={"Authorization": "Basic secret"}).headers["www-authenticate"] == \
            "Bearer"
        assert http.get("/health").status_code == 200
        # (vLLM leaves them open: they cost a worker's time.) With a slash after them too, which
        # had been redirected to the path before any key was asked for.
        for path in ("/tokenize", "/detokenize", "/tokenize/", "/detokenize//", "/v1/"):
            assert http.post(path, json={"prompt": "a", "tokens": [1]}, follow_redirects=False).status_code == 401
        assert http.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer secret"}
                         ).status_code == 200
        # Every /v1 path, as vLLM: an unknown one or a wrong method had been a 404 or 405 without
        # the key, telling a caller what exists.
        for method, path in [("GET", "/v1/nope"), ("POST", "/v1/models"), ("DELETE", "/v1/chat/completions")]:
            r = http.request(method, path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path)
        assert http.request("POST", "/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 405
        # A browser's preflight needs no key; a 401 carries the CORS headers.
        assert http.options("/v1/models", headers={"Origin": "http://a", "Access-Control-Request-Method": "GET"}
                            ).status_code == 200
        assert http.get("/v1/models", headers={"Origin": "http://a"}).headers["access-control-allow-origin"] == "*"


def test_an_internal_error_is_a_500_with_cors_headers(offline, monkeypatch):
    """An exception no handler takes is a 500 with a generic message that a browser's client can
    read: Starlette had answered it outside the CORS middleware, without its headers."""
    from fastapi.testclient import TestClient

    def fail(self, model):
        raise RuntimeError("a detail for the log only")

    monkeypatch.setattr(server_module._Server, "check_model", fail)
    with TestClient(build_app(AsyncLLM(offline), MODEL), raise_server_exceptions=False) as http:
        r = http.get(f"/v1/models/{MODEL}", headers={"Origin": "http://a"})
        assert r.status_code == 500 and r.headers["access-control-allow-origin"] == "*"
        assert r.json()["error"]["type"] == "server_error" and "log only" not in r.text
        assert http.get("/v1/models").status_code == 200  # and the server goes on


def test_vllms_options_without_an_equivalent_are_refused_with_the_way_forward(capsys):
    """A vLLM command line moved over: each of its options that has no equivalent here is named
    with what takes its place, beside argparse's usual refusal (=value forms too)."""
    from diffuserve.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["serve", "m", "--gpu-memory-utilization=0.9", "-tp", "2", "--enable-prefix-caching", "--bogus"])
    said = capsys.readouterr().err
    assert exit.value.code == 2
    assert "error: unrecognized arguments: --gpu-memory-utilization=0.9 -tp 2 --enable-prefix-caching --bogus" in said
    assert "(--gpu-memory-utilization is vLLM's: the KV cache is sized by --kv-cache-gib" in said
    assert "(-tp is vLLM's: one GPU runs the whole model" in said and "prefix caching is always on" in said
    assert "--bogus is" not in said


def test_serve_takes_its_key_from_vllms_variable_too(monkeypatch):
    """A deployment moved over from vLLM keeps its key: $VLLM_API_KEY is the default after
    $DIFFUSERVE_API_KEY (it had been unread, and the server open to every client)."""
    from diffuserve.cli import parser

    monkeypatch.delenv("DIFFUSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert parser().parse_args(["serve"]).api_key == "from-vllm"
    monkeypatch.setenv("DIFFUSERVE_API_KEY", "ours")
    assert parser().parse_args(["serve"]).api_key == "ours"
    assert parser().parse_args(["serve", "--api-key", "given"]).api_key == "given"


OTHER_TEMPLATE = "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"


def test_a_chat_template_given_to_the_server_renders_chats(offline, tmp_path):
    """vLLM's --chat-template: the server renders chat requests (and /tokenize's messages) with
    the template given, not the checkpoint's; one that does not compile, or one given for a
    model without a tokenizer, is refused when the app is built."""
    from fastapi.testclient import TestClient

    messages = [{"role": "user", "content": "Hello world"}]
    engine = AsyncLLM(offline)
    try:
        with TestClient(build_app(engine, MODEL, chat_template=OTHER_TEMPLATE)) as http:
            tokens = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
            chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4})
    finally:
        engine.shutdown()
    assert offline.tokenizer.decode(tokens, skip_special_tokens=False) == "[user] Hello world\n"
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(tokens)
    with pytest.raises(ValueError, match="the chat template does not compile"):
        build_app(types.SimpleNamespace(tokenizer=offline.tokenizer), MODEL, chat_template="{% if %}")
    bare = types.SimpleNamespace(tokenizer=None)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        build_app(bare, MODEL, chat_template=OTHER_TEMPLATE)


def test_serve_takes_a_chat_template_file_or_text(checkpoint, tmp_path):
    """serve --chat-template takes a file, or the template itself, as vLLM does; a missing
    file or a template that does not compile stops it, saying which, before the model loads."""
    path = tmp_path / "other.jinja"
    path.write_text(OTHER_TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}]
    for given in (str(path), OTHER_TEMPLATE):
        proc, port = _serve_process(checkpoint, "--chat-template", given)
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"model": MODEL, "messages": messages})
            assert r.json()["count"] == len(ds.LLM(checkpoint).tokenizer.encode("[user] Hi\n",
                                                                                add_special_tokens=False))
        finally:
            proc.kill()
            proc.wait()
    for given, said in [(str(tmp_path / "missing.jinja"), "No such file or directory"),
                        ("{% if %}", "the chat template does not compile"), (str(tmp_path), "Is a directory")]:
        out = subprocess.run([sys.executable, "-m", "diffuserve", "serve", "no-such-model", "--chat-template", given],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and out.stderr.startswith("error: --chat-template") and said in out.stderr, \
            out.stderr


def test_serve_takes_vllms_max_model_len(checkpoint):
    """--max-model-len (vLLM's) caps the longest sequence: the card says it, a request past it is
    a 400 naming it, and one without max_tokens fits within it."""
    proc, port = _serve_process(checkpoint, "--max-model-len", "100")
    url = f"http://127.0.0.1:{port}"
    try:
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 100
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5] * 80, "max_tokens": 32})
        assert r.status_code == 400 and "exceeds max_model_len (100)" in r.json()["error"]["message"], r.text
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5] * 60, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32, r.text  # 60 + 2 canvases of 16
    finally:
        proc.kill()
        proc.wait()


def test_a_context_of_2_to_the_31_positions_serves_requests_without_max_tokens(tmp_path):
    """Without max_tokens a request generates what fits its context: a model of 2^31 positions
    (or more) had refused every such request as a max_tokens of 2^31, which its client never
    sent."""
    path = write_random_checkpoint(tmp_path / "m", canvas_length=8, vocab_size=128, hidden_size=32,
                                   num_hidden_layers=2, max_position_embeddings=2**31)
    proc, port = _serve_process(str(path), "--kv-cache-gib", "0.001")
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": MODEL, "prompt": [2, 5, 9], "seed": 1, "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] > 0 and usage["completion_tokens"] % 8 == 0  # the whole blocks that fit
    finally:
        proc.kill()
        proc.wait()


def test_serve_serves_https_with_a_certificate(checkpoint, tmp_path):
    """serve --ssl-certfile / --ssl-keyfile (vLLM's): HTTPS; a key that is not the
    certificate's, or a key without a certificate, stops it with what is wrong."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make a certificate")
    cert, key, other = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "other.pem"
    for k, c in ((key, cert), (other, tmp_path / "other-cert.pem")):
        subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(k), "-out", str(c),
                        "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
    encrypted, encrypted_cert = tmp_path / "encrypted.pem", tmp_path / "encrypted-cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-passout", "pass:secret", "-keyout", str(encrypted),
                    "-out", str(encrypted_cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    trusted = ssl.create_default_context(cafile=str(cert))
    proc, port = _serve_process(checkpoint, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                                scheme="https", verify=trusted)
    try:
        r = httpx.post(f"https://127.0.0.1:{port}/v1/completions", verify=trusted,
                       json={"model": MODEL, "prompt": "x", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        with pytest.raises(httpx.TransportError):  # (plain HTTP gets no answer)
            httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        proc.kill()
        proc.wait()
    for options, said in [(["--ssl-certfile", str(cert), "--ssl-keyfile", str(other)], "KEY_VALUES_MISMATCH"),
                          (["--ssl-keyfile", str(key)], "--ssl-keyfile needs --ssl-certfile"),
                          (["--ssl-certfile", str(tmp_path / "none.pem")], "No such file or directory"),
                          # (refused, not a passphrase asked for on the terminal)
                          (["--ssl-certfile", str(encrypted_cert), "--ssl-keyfile", str(encrypted)], "not encrypted")]:
        out = subprocess.run([sys.executable, "-m", "diffuserve", "serve", "no-such-model", *options],
                             capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert out.returncode == 1 and out.stderr.startswith("error: --ssl-") and said in out.stderr, out.stderr


@pytest.mark.parametrize("key", ["", " secret", "clé", "a\nb"])
def test_api_keys_no_client_could_send_are_refused(offline, key):
    """An empty key (KEY= in an environment file) had locked every client out unannounced."""
    with pytest.raises(ValueError, match="API key must be printable ASCII"):
        build_app(None, MODEL, api_key=key)


async def _stream(base_url, i, leave_early):
    body = {"model": MODEL, "prompt": f"client {i}", "max_tokens": 96, "seed": i, "stream": True,
            "stream_drafts": True}
    if leave_early:  # far more work than the client waits for, at any machine speed
        body.update(max_tokens=2048, max_denoising_steps=1024, confidence_threshold=1e-30)
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", base_url + "/v1/completions", json=body) as r:
            lines = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if leave_early and len(lines) == 2:
                        return None  # closes the connection mid-stream
    return lines


def test_concurrent_streams_with_disconnects(base_url):
    async def main():
        return await asyncio.gather(*[_stream(base_url, i, leave_early=i % 2 == 1) for i in range(16)])
    before = metrics(base_url).get('diffuserve_requests_total{finish_reason="abort"}', 0)
    results = asyncio.run(main())
    for i, lines in enumerate(results):
        if i % 2 == 0:
            assert lines[-1] == "[DONE]"
            assert json.loads(lines[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    m = metrics_once_idle(base_url)
    assert m['diffuserve_requests_total{finish_reason="abort"}'] - before == 8
    assert m["diffuserve_denoise_steps_per_block_count"] > 0 and m["diffuserve_generation_tokens_total"] > 0


def metrics_once_idle(base_url, seconds=20) -> dict:
    """The metrics once no request runs or waits and every KV block is free (aborted requests
    free theirs as soon as the server notices their client left), at most `seconds` later."""
    deadline = time.time() + seconds
    while True:
        m = metrics(base_url)
        if (m["diffuserve_kv_blocks_free"] == m["diffuserve_kv_blocks_total"] and m["diffuserve_requests_running"]
                == m["diffuserve_requests_waiting"] == 0):
            return m
        assert time.time() < deadline, f"requests still running for a client that left: {m}"
        time.sleep(0.05)


def test_a_stream_of_many_choices_aborts_them_all_when_its_client_leaves(base_url):
    """A stream runs in an anyio cancel scope, which cancels its task again at every await once
    the client has left: the choices' cancellation, a turn of the event loop every 128, had
    stopped after the first 128, and the others ran on to their ends for nobody."""
    abort = 'diffuserve_requests_total{finish_reason="abort"}'
    before = metrics(base_url)[abort]
    body = {"model": MODEL, "prompt": ["first prompt", "second prompt"], "n": 100, "max_tokens": 2000,
            "ignore_eos": True, "stream": True, "seed": 0}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line)  # then the client leaves
    assert metrics_once_idle(base_url)[abort] - before == 200


def test_a_prompt_of_more_ids_than_max_model_len_is_refused_before_the_engine_reads_them(base_url):
    """Such a prompt's ids had all been read and checked on the engine thread first (10 million
    took 6 s of every request's steps), and the refusal named the KV cache, not max_model_len."""
    longest = httpx.get(base_url + "/v1/models").json()["data"][0]["max_model_len"]
    for prompt, name in [([5] * (longest + 1), "prompt"), ([[5, 6], [5] * (longest + 1)], "prompt[1]")]:
        r = httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (f"{name}: {longest + 1} tokens, more than this model's max_model_len "
                                                f"({longest}) takes")
        assert r.json()["error"]["param"] == name


def _serve_process(checkpoint, *options, patch: str = "", scheme: str = "http", verify=True, **popen):
    """`diffuserve serve` in a process of its own on a port it chooses (--port 0, printed in its
    "serving" line: it had printed port 0), once it answers /health: (process, port). `patch`:
    Python run in that process first (a fault to inject); scheme and verify: how it serves
    (https, with verify the certificate to trust)."""
    proc = subprocess.Popen([sys.executable, "-c", f"{patch}\nfrom diffuserve.cli import main\nmain()", "serve",
                             checkpoint, "--port", "0", "--served-model-name", MODEL, "--log-level", "warning",
                             *options], stderr=subprocess.PIPE, **popen)
    try:
        said = b""
        while b"serving" not in said:
            line = proc.stderr.readline()
            assert line, said.decode()
            said += line
        port = int(re.search(rb"serving tiny at " + scheme.encode() + rb"://127\.0\.0\.1:(\d+)/v1", said).group(1))
        assert port != 0
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"{scheme}://127.0.0.1:{port}/health", verify=verify).status_code == 200:
                    return proc, port
            except httpx.TransportError:
                assert time.time() < deadline and proc.poll() is None, proc.stderr.read().decode()
                time.sleep(0.1)
    except BaseException:
        proc.kill()  # a server that never answered is not left running
        raise


def test_serve_with_stdout_closed_serves(checkpoint):
    """With stdout closed (a supervisor's `>&-`), serve writes its log lines nowhere and serves
    (uvicorn's formatter had asked the missing stdout isatty: a traceback after "serving")."""
    proc, port = _serve_process(checkpoint, "--log-level", "info", preexec_fn=lambda: os.close(1))
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
    finally:
        proc.kill()


def test_serve_whose_stdout_reader_left_logs_no_tracebacks(checkpoint):
    """`serve | head -1`: once the reader of stdout has left, the access log's lines are dropped
    (each request had written a logging error's traceback to stderr)."""
    proc, port = _serve_process(checkpoint, "--log-level", "info", stdout=subprocess.PIPE)
    proc.stdout.close()
    try:
        for _ in range(3):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                                              "max_tokens": 4})
            assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        stderr = proc.communicate(timeout=60)[1].decode()
    assert "Logging error" not in stderr and "Traceback" not in stderr, stderr[-3000:]


def test_a_host_no_socket_can_encode_is_one_line(checkpoint):
    """--host with a name IDNA cannot encode is refused in a line (its TypeError had been a
    traceback)."""
    out = subprocess.run([sys.executable, "-m", "diffuserve", "serve", checkpoint, "--host", "\u00e9" * 70],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.startswith("error: cannot listen on ") and "Traceback" not in out.stderr


def test_serve_refuses_a_checkpoint_whose_default_steps_pass_the_limit(checkpoint, tmp_path):
    """--max-denoising-steps-limit holds for the checkpoint's own default, which every request
    that asks no number of steps runs: generation_config.json asking 2^31 - 1 steps a block had
    been served, each such request running for days. serve says so at start, in a line."""
    path = tmp_path / "many_steps"
    shutil.copytree(checkpoint, path)
    generation = json.loads((path / "generation_config.json").read_text())
    generation["max_denoising_steps"] = 2**31 - 1
    (path / "generation_config.json").write_text(json.dumps(generation))
    out = subprocess.run([sys.executable, "-m", "diffuserve", "serve", str(path), "--port", "0",
                          "--max-denoising-steps-limit", "64"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().endswith(
        "error: the checkpoint's default max_denoising_steps (2147483647, from generation_config.json) exceeds the "
        "limit of 64 a block that requests may run (--max-denoising-steps-limit): raise the limit to serve it")


def test_a_chat_template_that_renders_no_text_is_named(checkpoint, tmp_path):
    """A chat template that renders the conversation as no text (an empty chat_template.jinja)
    is named as the fault, by the server's chat endpoint (a 400 on messages) and by the CLI's
    generate: both had said only that the prompt was empty."""
    from fastapi.testclient import TestClient
    from diffuserve.chat_template import EMPTY_CHAT_PROMPT
    path = tmp_path / "empty_template"
    shutil.copytree(checkpoint, path)
    (path / "chat_template.jinja").write_text("")
    with TestClient(build_app(AsyncLLM(ds.LLM(str(path), kv_cache_memory_bytes=8 << 20)), MODEL)) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == EMPTY_CHAT_PROMPT
    assert r.json()["error"]["param"] == "messages"
    out = subprocess.run([sys.executable, "-m", "diffuserve", "generate", "Hi", "-m", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.strip().endswith(f"error: {EMPTY_CHAT_PROMPT} (--raw sends the "
                                                               "prompt as it is)"), out.stderr


def test_request_body_size_limit(checkpoint):
    """A body past --max-request-bytes is a 413 naming the limit, whether its Content-Length says
    so or it comes in chunks (a body of gigabytes had been read whole into memory, then decoded
    on the event loop); the server goes on serving."""
    proc, port = _serve_process(checkpoint, "--max-request-bytes", "2000")
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        data = json.dumps({"model": MODEL, "prompt": "x" * 3000, "max_tokens": 4}).encode()
        r = httpx.post(url, content=data, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert r.json()["error"]["message"] == (f"the request body is {len(data)} bytes, more than this server "
                                                "takes (2000 bytes, --max-request-bytes)")
        chunks = (data[i:i + 500] for i in range(0, len(data), 500))  # no Content-Length: chunked
        r = httpx.post(url, content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        r = httpx.post(url, json={"model": MODEL, "prompt": "x" * 1000, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
    finally:
        proc.kill()


def _stream_through_sigint(proc, port, body, signals: int = 1, sig=signal.SIGINT) -> list:
    """The data lines of a streamed completion, `signals` signals `sig` sent to the server after
    the first, half a second apart (signals of one kind that arrive together are one)."""
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        for i in range(signals):
            time.sleep(0.5 * (i > 0))
            proc.send_signal(sig)
        return [first] + [line for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_graceful_shutdown_finishes_running_requests(checkpoint, sig):
    """Ctrl-C or SIGTERM: the running request completes, and the server exits with status 0
    (after SIGTERM it had ended by the signal, status 143, once uvicorn raised it again)."""
    proc, port = _serve_process(checkpoint)
    try:
        body = {"model": MODEL, "prompt": "bye", "max_tokens": 128, "seed": 0, "max_denoising_steps": 48,
                "confidence_threshold": 1e-30}
        lines = _stream_through_sigint(proc, port, body, sig=sig)  # the running request still completes
        assert json.loads(lines[0][6:])["choices"][0]["finish_reason"] is None
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
        # The engine and the model go before the interpreter's end: nanobind had reported them as
        # leaked at every Ctrl-C (FastAPI's cache held the server's closures).
        assert b"leaked" not in proc.stderr.read()
    finally:
        proc.kill()


@pytest.mark.parametrize("timeout, signals", [("2", 1), ("600", 2)], ids=["timeout", "second signal"])
def test_shutdown_timeout_ends_streams_with_an_error(checkpoint, timeout, signals):
    """A request still running a second before --shutdown-timeout runs out, or at a second
    Ctrl-C, is ended by the engine: its stream gets an error event and [DONE] (the connection
    had been dropped mid-response, which a client cannot tell from a network fault; at a
    second Ctrl-C, with tracebacks in the server's log)."""
    proc, port = _serve_process(checkpoint, "--shutdown-timeout", timeout)
    try:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 2048, "seed": 0, "max_denoising_steps": 1024,
                "confidence_threshold": 1e-30}
        lines = _stream_through_sigint(proc, port, body, signals)
        assert lines[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(lines[-2][6:])["error"]["message"]
        assert proc.wait(timeout=30) == 0
        assert b"Traceback" not in proc.stderr.read()
    finally:
        proc.kill()


def test_shutdown_ends_the_engine_a_pass_before_the_timeout(checkpoint):
    """Forward passes longer than a second (a CPU's, at a large batch): the engine is ended as
    the signal comes, where --shutdown-timeout (3 s) leaves less than two passes and a second,
    and its stream ends with the error and [DONE] before the timeout (the engine had been ended
    a second before it, as the pass in progress went on: the connection cut mid-response)."""
    patch = """import functools, time
from diffuserve.llm import LLM
LLM.__init__ = functools.partialmethod(LLM.__init__, slice_steps=1)  # a step: one pass
step = LLM._step_for
LLM._step_for = lambda self, claimant: (time.sleep(2.5), step(self, claimant))[1]  # a pass of 2.5 s"""
    proc, port = _serve_process(checkpoint, "--shutdown-timeout", "3", patch=patch)
    try:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 2048, "seed": 0, "max_denoising_steps": 1024,
                "confidence_threshold": 1e-30, "stream": True, "stream_drafts": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # a draft: a pass has run
            time.sleep(1)  # into the next: a pass begun after the timeout's last second would end past it
            proc.send_signal(signal.SIGINT)
            lines = [line for line in lines if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(lines[-2][6:])["error"]["message"]
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_an_engine_that_fails_ends_the_server(checkpoint):
    """A bug that stops the engine thread: the request gets a 503, and the server exits with
    status 1 and the error (it had stayed up answering every request, /health too, with 503)."""
    patch = """from diffuserve.llm import LLM
def fail(self, claimant):
    raise RuntimeError("a bug in the engine")
LLM._step_for = fail"""
    proc, port = _serve_process(checkpoint, patch=patch)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 4})
        assert r.status_code == 503 and "the engine failed" in r.json()["error"]["message"]
        assert proc.wait(timeout=30) == 1
        assert "error: the engine failed (RuntimeError('a bug in the engine')); the server has stopped" in \
            proc.stderr.read().decode()
    finally:
        proc.kill()


def test_plain_request_aborted_when_client_leaves(base_url):
    before = metrics(base_url).get('diffuserve_requests_total{finish_reason="abort"}', 0)
    # Tens of seconds of work at any machine speed: the client gives up long before. (Seeded,
    # EOS ignored: once in several CI runs the unseeded request answered within the client's
    # half second, most likely a draw that ended the text in its first block.)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 2048, "confidence_threshold": 1e-30,
            "max_denoising_steps": 1024, "seed": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base_url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    deadline = time.time() + 20
    while True:  # the abort is counted when requested; the engine thread frees the KV right after
        m = metrics(base_url)
        if m.get('diffuserve_requests_total{finish_reason="abort"}', 0) > before and \
                m["diffuserve_kv_blocks_free"] == m["diffuserve_kv_blocks_total"]:
            break
        assert time.time() < deadline, f"the request was not aborted: {m}"
        time.sleep(0.05)


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(checkpoint):
    """A step the runtime refuses (out of GPU memory, say, raised as ValueError) fails the
    requests in it, with the reason, and frees their KV; the next request runs."""
    llm = ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20)
    real_step, failures = llm._step_for, ["out of GPU memory allocating 2147483648 bytes"]

    def step(claimant):  # (AsyncLLM's step)
        if failures:
            raise ValueError(failures.pop())
        return real_step(claimant)

    llm._step_for = step
    engine = AsyncLLM(llm)
    params = ds.SamplingParams(max_new_tokens=8, seed=0)

    try:
        with pytest.raises(StepFailed, match="out of GPU memory allocating 2147483648 bytes"):
            asyncio.run(stream_to_the_end(engine, [5, 6, 7], params))
        wait_until_idle(engine, 10)
        assert len(asyncio.run(stream_to_the_end(engine, [5, 6, 7], params)).token_ids) == 8
    finally:
        engine.shutdown()


def test_a_step_failing_after_a_request_finished_delivers_it(checkpoint):
    """A step that fails after one of its requests finished: that one gets its output, the
    other StepFailed, and the engine goes on (the finished id had been aborted as if still
    running, which raised "no request with id N" and killed the engine thread)."""
    from test_batching import FailsAfterAFinish
    llm = ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20, slice_steps=4)
    llm.scheduler.engine = FailsAfterAFinish(llm.scheduler.engine)
    engine = AsyncLLM(llm)

    async def run(tokens):
        params = ds.SamplingParams(max_new_tokens=tokens, seed=0, eos_token_id=[])
        return [p.output async for p in engine.generate([5, 6, 7], params)][-1]

    async def both():
        return await asyncio.gather(run(8), run(64), return_exceptions=True)

    try:
        short, long = asyncio.run(both())
        assert len(short.token_ids) == 8
        assert isinstance(long, StepFailed) and "out of memory allocating the logits" in str(long)
        assert engine.alive and len(asyncio.run(run(8)).token_ids) == 8
    finally:
        engine.shutdown()


def test_max_tokens_wins_over_the_checkpoints_max_length(tmp_path):
    """A request without max_tokens takes the checkpoint's defaults, generation_config.json's
    max_length included, as transformers' generate does (it had been ignored); with max_tokens
    (or max_completion_tokens) the request gets that many tokens, as OpenAI means them."""
    from fastapi.testclient import TestClient
    path = write_chat_checkpoint(tmp_path)
    file = os.path.join(path, "generation_config.json")
    with open(file) as f:
        generation = json.load(f)
    with open(file, "w") as f:
        json.dump({**generation, "max_length": 20, "eos_token_id": [], "max_denoising_steps": 2}, f)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "seed": 0}
    with TestClient(build_app(AsyncLLM(ds.LLM(path)), MODEL)) as http:
        def usage(endpoint, body):
            r = http.post(f"/v1/{endpoint}", json=body)
            assert r.status_code == 200, r.text
            return r.json()["usage"]

        for endpoint, body in (("completions", {"model": MODEL, "prompt": [5, 6, 7]}), ("chat/completions", chat)):
            assert usage(endpoint, body)["total_tokens"] == 20, endpoint
        assert usage("completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 24})["completion_tokens"] == 24
        assert usage("chat/completions", {**chat, "max_completion_tokens": 40})["completion_tokens"] == 40
        # A prompt that leaves max_length no room: refused, naming both, unless max_tokens is given.
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 25})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            "max_length 20: the prompt (25 tokens) leaves no room for new tokens"), r.text
        assert usage("completions", {"model": MODEL, "prompt": [5] * 25, "max_tokens": 4})["completion_tokens"] == 4


def test_usage_counts_through_a_stop_string_that_ends_in_byte_tokens(tmp_path):
    """A stop string whose last character is byte-fallback tokens (an emoji the vocabulary lacks:
    four of them): completion_tokens counts through the token that ends it. A prefix that ends
    inside the character decodes to a U+FFFD a byte, longer than the character, and the binary
    search on those lengths had counted 2 of 5 tokens."""
    from diffuserve.detokenizer import IncrementalDetokenizer
    from diffuserve.stop_strings import StopStringFilter
    from diffuserve.tokenizer import Tokenizer
    tokenizer = Tokenizer(write_chat_checkpoint(tmp_path / "m", byte_fallback=True))
    ids = tokenizer.encode("x🐍 tail", add_special_tokens=False)
    assert len(ids) > 5 and all(tokenizer.ends_in_byte_run(ids[:k]) for k in (2, 3, 4, 5))  # x, then 4 bytes
    detokenizer, stops = IncrementalDetokenizer(tokenizer), StopStringFilter(["🐍"])
    assert "".join(stops.push(detokenizer.push([i])) for i in ids) == "x" and stops.stop_end == 2
    assert TokensThrough(tokenizer)(ids, stops.stop_end) == 5
    # The byte run reaching the end of the tokens (a second emoji, the last generated): its text
    # comes out only as the output finishes, and every token had been counted.
    ids = tokenizer.encode("x🐍🐍", add_special_tokens=False)
    assert len(ids) == 9 and tokenizer.ends_in_byte_run(ids)
    detokenizer, stops = IncrementalDetokenizer(tokenizer), StopStringFilter(["🐍"])
    text = "".join(stops.push(detokenizer.push([i])) for i in ids) + stops.push(detokenizer.finish())
    assert text == "x" and stops.stop_end == 2
    assert TokensThrough(tokenizer)(ids, stops.stop_end, final=True) == 5
    # One counter as the output grows, asked after each block for the text streamed so far and
    # for points inside it (as token ids go out beside stop strings), against the definition:
    # the fewest tokens whose text begins with the output's first `end` characters.
    rng = random.Random(0)
    ids = tokenizer.encode("ab🐍 cd 鬱龘靐齉 🐍🐍 efg 🦀 hij " * 6, add_special_tokens=False)
    counter, stream, streamed, calls = TokensThrough(tokenizer), IncrementalDetokenizer(tokenizer), "", 0
    for block_end in range(7, len(ids) + 1, 7):
        streamed += stream.push(ids[block_end - 7:block_end])
        for end in sorted({len(streamed), *(rng.randint(1, max(len(streamed), 1)) for _ in range(3))}):
            if 0 < end <= len(streamed):
                fewest = next(m for m in range(len(ids) + 1)
                              if tokenizer.decode_output(ids[:m]).startswith(streamed[:end]))
                assert counter(ids[:block_end], end) == fewest, (block_end, end)
                calls += 1
    assert calls > 40


def test_tokens_through_a_stop_string_where_decoding_cleans_up_spaces(tmp_path):
    """A tokenizer whose decoding cleans up spaces (" ," to ","): the count is still the fewest
    tokens whose cleaned text begins with the output's first `end` characters, asked as the
    output grows and at its end. The text before the clean-up had been compared with the cleaned
    text, and the count had run to the whole output."""
    from diffuserve.detokenizer import IncrementalDetokenizer
    from diffuserve.tokenizer import Tokenizer
    tokenizer = Tokenizer(write_clean_up_tokenizer(tmp_path))
    rng = random.Random(0)
    words = CLEAN_UP_CORPUS.split()
    for _ in range(60):
        ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(rng.randrange(2, 40))))
        text = tokenizer.decode_output(ids)
        prefixes = [tokenizer.decode_output(ids[:m]) for m in range(len(ids) + 1)]
        counter, stream, streamed = TokensThrough(tokenizer), IncrementalDetokenizer(tokenizer), ""
        for block_end in range(4, len(ids) + 4, 4):
            final = block_end >= len(ids)
            streamed += stream.push(ids[block_end - 4:block_end]) + (stream.finish() if final else "")
            for end in sorted({len(streamed), rng.randint(1, max(len(streamed), 1))}):
                if 0 < end <= len(streamed):
                    fewest = next(m for m, prefix in enumerate(prefixes) if prefix.startswith(text[:end]))
                    assert counter(ids[:block_end], end, final) == fewest, (ids, end)
    ids = tokenizer.encode("do n't , fine")
    assert tokenizer.decode_output(ids) == "don't, fine"
    assert TokensThrough(tokenizer)(ids, 3, final=True) == next(
        m for m in range(len(ids)) if tokenizer.decode_output(ids[:m]).startswith("don"))


@pytest.mark.parametrize("text", ["ab " + "🦄鯨∑靐" * 8 + " cd 🐍🐍🐍 e", "x" + "🦀" * 20])
def test_tokens_through_a_long_byte_run_as_defined(tmp_path, text):
    """Inside a long byte run (one piece of the detokenizer's, which TokensThrough bisects
    rather than decoding every prefix of) the count is still the fewest tokens whose text
    begins with the output's first `end` characters, at every `end`."""
    from diffuserve.tokenizer import Tokenizer
    tokenizer = Tokenizer(write_chat_checkpoint(tmp_path / "m", byte_fallback=True))
    ids = tokenizer.encode(text, add_special_tokens=False)
    counter = TokensThrough(tokenizer)
    assert counter(ids, len(text), final=True) == len(ids)
    assert max(np.diff(counter._tokens)) > stop_strings._SCANNED_PIECE  # a piece the count bisects
    prefixes = [tokenizer.decode_output(ids[:m]) for m in range(len(ids) + 1)]
    for end in range(1, len(text) + 1):
        fewest = next(m for m, prefix in enumerate(prefixes) if prefix.startswith(text[:end]))
        assert TokensThrough(tokenizer)(ids, end, final=True) == fewest, end


def test_a_tokenizer_with_ids_past_the_models_vocabulary_is_blamed(tmp_path):
    """A tokenizer.json whose ids pass the model's vocabulary (a checkpoint put together from
    two models) is named as the fault, in LLM.add_request and in the server's 400, where the
    text's token id had been reported as the prompt's out-of-range id, the client's fault."""
    from fastapi.testclient import TestClient
    from chat_checkpoint import train_tokenizer
    from diffuserve.random_checkpoint import write_random_checkpoint
    path = write_random_checkpoint(tmp_path / "m", canvas_length=8, **{**MODEL_CONFIG, "vocab_size": 300})
    tokenizer = train_tokenizer(vocab_size=400)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    text = " ".join(t for t, i in tokenizer.get_vocab().items() if i >= 300 and t.isalpha())
    llm = ds.LLM(path)
    assert max(llm.tokenizer.encode(text)) >= 300
    message = r"the checkpoint's tokenizer encodes this text to token id 3\d\d, past the model's vocabulary of 300 ids"
    with pytest.raises(ValueError, match="prompt: " + message):
        llm.add_request(text)
    assert llm.generate([[5, 6]], ds.SamplingParams(max_new_tokens=8, seed=0))[0].token_ids  # the model still serves
    with TestClient(build_app(AsyncLLM(llm), MODEL)) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 8})
        assert r.status_code == 400 and re.match("prompt: " + message, r.json()["error"]["message"]), r.text
        assert r.json()["error"]["param"] == "prompt"
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 8})
        assert r.status_code == 200, r.text


def test_a_model_without_a_tokenizer_is_served_token_ids(tmp_path):
    """A checkpoint without tokenizer.json (what save_pretrained writes) is served: completions
    take token ids and give each choice's token_ids (as vLLM's return_token_ids), with the same
    ids as LLM.generate; text, chat, stop strings and drafts, which need a tokenizer, are 400s
    naming it. (The server had refused to start; a stream's drafts had been left out silently.)"""
    from fastapi.testclient import TestClient
    from diffuserve.random_checkpoint import write_random_checkpoint
    path = write_random_checkpoint(tmp_path / "bare", canvas_length=8, **MODEL_CONFIG)
    llm = ds.LLM(path)
    expected = llm.generate([[5, 6, 7]], ds.SamplingParams(max_new_tokens=16, seed=3))[0].token_ids
    with TestClient(build_app(AsyncLLM(ds.LLM(path)), MODEL)) as http:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 16, "seed": 3}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == expected and choice["text"] == ""
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
        assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == expected
        for endpoint, bad, param in (("completions", {"prompt": "text"}, "prompt"),
                                     ("completions", {"stop": ["x"]}, "stop"),
                                     ("completions", {"stream": True, "stream_drafts": True}, "stream_drafts"),
                                     ("chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                                      "messages")):
            r = http.post(f"/v1/{endpoint}", json={**body, "prompt": [5], **bad} if endpoint == "completions"
                          else {"model": MODEL, **bad})
            assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer", r.text
            assert r.json()["error"]["param"] == param and "tokenizer.json" in r.json()["error"]["message"]


def test_return_token_ids_beside_text(client, offline):
    """return_token_ids (vLLM's) gives each choice's token ids beside its text: the ids the
    engine generated, in a plain response and summed over a stream's chunks."""
    body = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=16, seed=4)
    expected = offline.generate([[5, 6, 7]], ds.SamplingParams(max_new_tokens=16, seed=4))[0]
    plain = client.completions.create(**body, extra_body={"return_token_ids": True})
    assert plain.choices[0].model_extra["token_ids"] == expected.token_ids
    assert "token_ids" not in client.completions.create(**body).choices[0].model_extra
    chunks = list(client.completions.create(**body, stream=True, extra_body={"return_token_ids": True}))
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == expected.token_ids


def test_cors_and_the_model_card(base_url, checkpoint):
    """Browsers' preflight requests are answered (as vLLM, any origin by default: they had been
    405s), and the model card gives max_model_len as vLLM's does: what one request can reach
    (the fixture's 32 MiB KV cache holds less than the 131,072 positions; it had said 131,072)."""
    r = httpx.options(base_url + "/v1/chat/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://example.com")
    card = httpx.get(base_url + "/v1/models").json()["data"][0]
    longest = ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20).model.max_sequence_tokens
    assert card["max_model_len"] == longest < 131072 and card["root"] == MODEL and card["created"] > 0


def test_a_developer_role_named_only_in_a_comment_is_not_the_templates():
    """Whether the chat template takes developer messages is read from its code, not from a
    comment mentioning the word (which had made developer messages a 400)."""
    names = names_role
    assert names("{% if message['role'] == 'developer' %}", "developer")
    assert not names("{# developer messages are system ones #}{{ message['role'] }}", "developer")


def test_token_ids_end_where_a_stop_string_ends_the_text(client):
    """With a stop string, a choice's token_ids end with the token that ends it, as
    completion_tokens counts, in a plain response and over a stream's chunks: the stream had sent
    a block's ids while its text was held back, past the stop that then cut the text."""
    body = dict(model=MODEL, prompt="hello world", max_tokens=48, seed=7, temperature=1.0)
    text = client.completions.create(**body).choices[0].text
    for stop in (text[3:7], text[10:13]):
        plain = client.completions.create(**body, stop=[stop], extra_body={"return_token_ids": True})
        assert len(plain.choices[0].model_extra["token_ids"]) == plain.usage.completion_tokens, stop
        chunks = list(client.completions.create(**body, stop=[stop], stream=True, stream_options={"include_usage": True},
                                                extra_body={"return_token_ids": True}))
        ids = sum((c.choices[0].model_extra["token_ids"] for c in chunks if c.choices), [])
        assert ids == plain.choices[0].model_extra["token_ids"] and len(ids) == chunks[-1].usage.completion_tokens


def test_allowed_origins_leave_the_model_argument_alone():
    """--allowed-origins takes one origin a time (repeated for more): taking any number, it had
    swallowed a MODEL written after it, and the bundled model had been served instead."""
    from diffuserve.cli import parser
    args = parser().parse_args(["serve", "--allowed-origins", "http://a.example", "/ckpt",
                                "--allowed-origins", "http://b.example"])
    assert args.model == "/ckpt" and args.allowed_origins == [["http://a.example"], ["http://b.example"]]
    assert parser().parse_args(["serve"]).allowed_origins is None  # any origin (build_app's "*")
    # vLLM's form, a JSON list (it had been one origin of that name, matching none).
    args = parser().parse_args(["serve", "--allowed-origins", '["http://a.example", "http://c.example"]'])
    assert args.allowed_origins == [["http://a.example", "http://c.example"]]


def test_an_app_driven_without_its_lifespan_lets_its_engine_go(checkpoint):
    """An app driven over ASGI without its lifespan (httpx's ASGITransport, as tests and
    embedders do), then dropped: its engine and model are freed. (FastAPI's process-wide cache
    of endpoints had held them through the endpoints' closures: a model for each app built.)"""
    engine = AsyncLLM(ds.LLM(checkpoint, kv_cache_memory_bytes=8 << 20))
    gone = weakref.ref(engine)
    app = build_app(engine, MODEL)

    async def ask(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200, r.text
    asyncio.run(ask(app))
    del app, engine
    gc.collect()
    assert gone() is None


def test_async_llms_leave_no_exit_hooks_behind(checkpoint):
    """Each AsyncLLM's engine thread is stopped at exit by one hook for them all (each had
    registered its own, kept for the process's life)."""
    AsyncLLM(ds.LLM(checkpoint, kv_cache_memory_bytes=8 << 20)).shutdown()  # (hooks made once a process)
    before = atexit._ncallbacks()
    for _ in range(3):
        AsyncLLM(ds.LLM(checkpoint, kv_cache_memory_bytes=8 << 20)).shutdown()
    assert atexit._ncallbacks() == before


def test_a_shut_down_app_frees_its_model_and_answers_503(checkpoint):
    """Once its lifespan has ended, the app (still held, as a test holds it) frees the model,
    and a request that still comes is a 503 naming the shutdown (it had been a 500)."""
    from fastapi.testclient import TestClient
    engine = AsyncLLM(ds.LLM(checkpoint, kv_cache_memory_bytes=8 << 20))
    llm = weakref.ref(engine.llm)
    app = build_app(engine, MODEL)
    del engine
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
    gc.collect()
    assert llm() is None
    r = http.get("/health")
    assert r.status_code == 503 and r.json()["error"]["message"] == "the server has shut down"


def test_an_llm_shared_by_an_async_llm_and_other_threads_finishes_everyones_requests(checkpoint):
    """Another thread's generate() (or a second AsyncLLM) on the LLM an AsyncLLM serves: its
    steps finished the engine's requests between the engine's step and its questions about
    them, and every one of the engine's requests failed (StepFailed: no request with id N);
    a second AsyncLLM's requests all failed so; and a plain add_request/step() loop took the
    outputs of the AsyncLLMs' requests, failing them all too. Now each finishes with its own
    output."""
    llm = ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20)
    params = ds.SamplingParams(max_new_tokens=120, seed=0, eos_token_id=[])
    alone = llm.generate([[2, 5, 6], [2, 5, 7], [2, 5, 8]], params)
    engine, second = AsyncLLM(llm), AsyncLLM(llm)

    def step_loop():  # vLLM's LLMEngine idiom, beside the AsyncLLMs
        request_id, outputs = llm.add_request([2, 5, 8], params), []
        while not any(out.request_id == request_id for out in outputs):
            outputs += llm.step()
        return outputs

    async def main():
        streams = [asyncio.create_task(stream_to_the_end(e, [2, 5, 6], params)) for e in (engine, second) * 3]
        await asyncio.sleep(0.2)  # the streams are running
        generated, stepped = await asyncio.gather(asyncio.to_thread(llm.generate, [[2, 5, 7]], params),
                                                  asyncio.to_thread(step_loop))
        return await asyncio.gather(*streams), generated, stepped

    try:
        streamed, generated, stepped = asyncio.run(main())
        assert [out.token_ids for out in streamed] == [alone[0].token_ids] * 6
        assert generated[0].token_ids == alone[1].token_ids
        assert [out.token_ids for out in stepped] == [alone[2].token_ids]  # its own output alone
        # Every caller has its output: nothing is left running. (The LLM's own stats: an
        # AsyncLLM's are refreshed by its own steps, and another thread's may have come last.)
        stats = llm.stats()
        assert stats["running"] == stats["waiting"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        engine.shutdown()
        second.shutdown()


def test_progress_says_when_the_engine_first_ran_a_request(checkpoint):
    """Progress.scheduled_at (the server's queue-time metric): the start of the engine step that
    first ran the request, the same in every update from its first run on and before each
    update was read; a request queued behind another (one sequence at a time) ran later."""
    engine = AsyncLLM(ds.LLM(checkpoint, max_num_seqs=1, slice_steps=1))
    params = ds.SamplingParams(max_new_tokens=48, seed=0, eos_token_id=[])

    async def run(prompt):
        updates = []
        async for progress in engine.generate(prompt, params):
            updates.append((time.monotonic(), progress))
        return updates

    async def main():
        return await asyncio.gather(run([5, 6]), run([5, 7]))

    try:
        added = time.monotonic()
        first, second = asyncio.run(main())
    finally:
        engine.shutdown()
    for updates in (first, second):
        assert updates[0][1].scheduled_at is None and updates[-1][1].output is not None  # (acceptance, end)
        ran = updates[-1][1].scheduled_at
        assert all(p.scheduled_at == ran and ran <= received for received, p in updates[1:])
    assert added < first[-1][1].scheduled_at < second[-1][1].scheduled_at


def test_updates_a_slow_reader_has_not_read_are_one_progress(checkpoint):
    """A caller that reads its stream slowly (a server's client on a slow link) finds one
    Progress, the latest, where one a step had queued up, each with every token so far
    (memory quadratic in the output: 860 MB for 24,000 tokens). The stream still ends with
    the output, and its tokens are those of a caller that kept up."""
    llm = ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20, slice_steps=1)
    engine = AsyncLLM(llm)
    params = ds.SamplingParams(max_new_tokens=200, seed=0, eos_token_id=[], max_denoising_steps=1)

    async def main():
        passes = engine.stats["forward_passes"]
        updates = engine.generate([2, 5, 6], params)
        accepted = await updates.__anext__()
        # It finishes, its caller reading nothing: its 13 blocks' passes run and nothing is left
        # (the stats are refreshed after each step: right after acceptance they could still show
        # none running, and the stream had been read as it went, once in a CI run).
        while engine.stats["running"] or engine.stats["waiting"] or engine.stats["forward_passes"] < passes + 13:
            await asyncio.sleep(0.01)
        return accepted, [progress async for progress in updates]

    try:
        accepted, later = asyncio.run(main())
        assert accepted.token_ids == [] and accepted.output is None
        assert len(later) <= 2 and later[-1].output is not None  # (the last block's progress, then the output)
        assert later[-1].output.token_ids == llm.generate([[2, 5, 6]], params)[0].token_ids
    finally:
        engine.shutdown()


def test_each_caller_of_a_shut_down_engine_gets_its_own_error(checkpoint):
    """The requests a shutdown ends each raise an EngineDead of their own: one instance raised
    in every caller had gathered all their tracebacks (and each caller's notes). A request
    that failed does not interrupt the others' step as it leaves."""
    llm = ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20)
    interrupts = []
    interrupt = llm.interrupt
    llm.interrupt = lambda: (interrupts.append(1), interrupt())
    engine = AsyncLLM(llm)
    params = ds.SamplingParams(max_new_tokens=2000, seed=0, eos_token_id=[])

    async def main():
        streams = [asyncio.create_task(stream_to_the_end(engine, [2, 5, 6], params)) for _ in range(4)]
        while engine.stats["running"] < 4:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.shutdown)
        return await asyncio.gather(*streams, return_exceptions=True)

    errors = asyncio.run(main())
    assert all(isinstance(e, EngineDead) and str(e) == "the server is shutting down" for e in errors), errors
    assert len({id(e) for e in errors}) == 4
    assert len(interrupts) == 1  # the shutdown's own (each caller's had followed)


def test_stats_show_a_request_gone_once_its_output_is_read(checkpoint):
    """The engine's stats are refreshed before a step's outputs are posted: read just after a
    request's output they had still shown it running, its KV blocks held."""
    engine = AsyncLLM(ds.LLM(checkpoint, kv_cache_memory_bytes=32 << 20))
    params = ds.SamplingParams(max_new_tokens=16, seed=0)

    async def main():
        seen = []
        for _ in range(5):
            await stream_to_the_end(engine, [2, 5, 6], params)
            stats = engine.stats
            seen.append((stats["running"], stats["kv_blocks_free"] == stats["kv_blocks_total"]))
        return seen

    try:
        assert asyncio.run(main()) == [(0, True)] * 5
    finally:
        engine.shutdown()


def test_a_stream_stopped_by_a_stop_string_sends_no_draft_past_it(checkpoint):
    """The draft is of the block after the text so far; once a stop string ends the text it is
    text the output will never have. The finishing chunk had carried the next block's draft
    whenever the engine had started that block before the stop was found."""
    engine = AsyncLLM(ds.LLM(checkpoint, kv_cache_memory_bytes=8 << 20))
    try:
        server = server_module._Server(engine, MODEL)
        tokenizer = server.tokenizer
        first, second = tokenizer.encode("hello", False), tokenizer.encode(" world", False)
        draft = tokenizer.encode(" again", False)

        async def generate(prompt, params, drafts):  # the engine's updates, as AsyncLLM posts them
            yield Progress([])  # accepted
            yield Progress(first, draft)  # a block committed, the next one refining
            yield Progress(first + second, draft)  # the stop string is in the new block

        server.engine = types.SimpleNamespace(generate=generate)

        async def events():
            choice = server_module._Choice(server, 0, [5], ds.SamplingParams(), ["wor"], True,
                                           server_module.Usage(), True, {}, False)
            await choice.start()
            return [event async for event in choice.events()]

        before, stopped = asyncio.run(events())
        assert before.draft == tokenizer.decode_output(draft) and before.finish_reason is None
        assert stopped.finish_reason == "stop" and stopped.draft is None
        assert before.text + stopped.text == "hello "
    finally:
        engine.shutdown()
