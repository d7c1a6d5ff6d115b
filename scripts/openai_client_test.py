#!/usr/bin/env python3
"""Drives a running `nibble serve` with the official `openai` Python client.

Usage: openai_client_test.py BASE_URL API_KEY   (BASE_URL like http://127.0.0.1:8080/v1)

Checks: models list; chat non-streaming and streaming (same greedy text, finish reason, usage in
the final chunk and the include_usage chunk); completions both ways; logprobs and logit_bias;
structured outputs (the SDK's pydantic `parse` and a forced tool call); a 400 (BadRequestError with
the server's message) and a 401 (AuthenticationError). Exits non-zero on the first failure.
"""
import json
import sys
from typing import Literal

import openai
import pydantic


def main() -> None:
    base, key = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)

    models = client.models.list()
    ids = [m.id for m in models.data]
    assert len(ids) == 1, ids
    model = ids[0]

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(
        model=model, messages=msgs, temperature=0, max_tokens=10, extra_body=extra
    )
    assert r.object == "chat.completion", r
    text = r.choices[0].message.content
    assert isinstance(text, str) and text, r
    assert r.choices[0].finish_reason in ("stop", "length"), r
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 5, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    pieces, finish, usage, roles = [], None, None, []
    stream = client.chat.completions.create(
        model=model, messages=msgs, temperature=0, max_tokens=10, stream=True,
        stream_options={"include_usage": True}, extra_body=extra,
    )
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk", chunk
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        if c.delta.role:
            roles.append(c.delta.role)
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
    assert roles == ["assistant"], roles
    assert "".join(pieces) == text, (pieces, text)
    assert finish == r.choices[0].finish_reason, finish
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage
    # The repeat reused the cached prompt.
    assert usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1, usage

    c = client.completions.create(model=model, prompt="Once upon a time", temperature=0, max_tokens=8)
    assert c.object == "text_completion", c
    ctext = c.choices[0].text
    assert ctext and c.usage.completion_tokens <= 8, c
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model=model, prompt="Once upon a time", temperature=0, max_tokens=8, stream=True
        )
        if ch.choices
    )
    assert streamed == ctext, (streamed, ctext)

    # Logprobs, logit_bias and the typed objects the SDK builds from them.
    lp = client.chat.completions.create(
        model=model, messages=msgs, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2
    )
    entries = lp.choices[0].logprobs.content
    assert len(entries) == lp.usage.completion_tokens, lp
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries), entries
    assert entries[0].top_logprobs[0].logprob == entries[0].logprob, entries[0]
    bang = client.completions.create(
        model=model, prompt="Hi", temperature=0, max_tokens=3, logit_bias={"0": 100}, logprobs=1
    )
    assert bang.choices[0].text == "!!!", bang
    assert bang.choices[0].logprobs.tokens == ["!", "!", "!"], bang.choices[0].logprobs
    # A prompt scored, not continued: echo with logprobs and max_tokens 0 (the first entry is
    # null), and vLLM's prompt_logprobs through extra_body (one entry per prompt token).
    scored = client.completions.create(
        model=model, prompt="Once upon a time", echo=True, logprobs=1, max_tokens=0,
        extra_body={"prompt_logprobs": 1},
    )
    sl = scored.choices[0].logprobs
    assert scored.choices[0].text == "Once upon a time", scored
    assert sl.token_logprobs[0] is None and all(x <= 0 for x in sl.token_logprobs[1:]), sl
    assert "".join(sl.tokens) == "Once upon a time", sl.tokens
    plp = scored.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == scored.usage.prompt_tokens and plp[0] is None, plp

    # n choices: each its own sequence (seeded one apart), the prompt counted once.
    many = client.chat.completions.create(
        model=model, messages=msgs, temperature=1, seed=7, n=3, max_tokens=8, extra_body=extra
    )
    assert [c.index for c in many.choices] == [0, 1, 2], many
    one = client.chat.completions.create(
        model=model, messages=msgs, temperature=1, seed=8, max_tokens=8, extra_body=extra
    )
    assert many.choices[1].message.content == one.choices[0].message.content, (many, one)
    assert many.usage.prompt_tokens == one.usage.prompt_tokens, many.usage
    seen = {}
    for chunk in client.chat.completions.create(
        model=model, messages=msgs, temperature=1, seed=7, n=3, max_tokens=8, stream=True,
        extra_body=extra,
    ):
        for c in chunk.choices:
            seen[c.index] = seen.get(c.index, "") + (c.delta.content or "")
    assert [seen[i] for i in range(3)] == [c.message.content for c in many.choices], seen

    # Structured outputs: the SDK's own pydantic path (a strict json_schema) and a forced call.
    class Ball(pydantic.BaseModel):
        color: Literal["red", "green", "blue"]
        ok: bool

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    ball = parse(model=model, messages=msgs, temperature=0, max_tokens=60,
                 response_format=Ball, extra_body=extra)
    parsed = ball.choices[0].message.parsed
    assert isinstance(parsed, Ball), ball
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"side": {"enum": ["left", "right"]}},
        "required": ["side"], "additionalProperties": False}}}]
    call = client.chat.completions.create(
        model=model, messages=msgs, temperature=0, max_tokens=60, tools=tools,
        tool_choice={"type": "function", "function": {"name": "pick"}}, extra_body=extra,
    )
    assert call.choices[0].finish_reason == "tool_calls", call
    fn = call.choices[0].message.tool_calls[0].function
    assert fn.name == "pick" and json.loads(fn.arguments)["side"] in ("left", "right"), fn

    try:
        client.chat.completions.create(model=model, messages=msgs, temperature=-1)
        raise AssertionError("negative temperature was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400
        assert "temperature" in e.message, e.message
        assert e.body["param"] == "temperature", e.body

    bad = openai.OpenAI(base_url=base, api_key=key + "-wrong", max_retries=0, timeout=30)
    try:
        bad.models.list()
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError as e:
        assert e.status_code == 401

    print(f"openai {openai.__version__} client test: ok (chat {text!r}, completion {ctext!r})")


if __name__ == "__main__":
    main()
