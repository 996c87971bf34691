"""Drives a levee engine with the official `openai` package; prints one JSON line per check.

Usage: openai_client.py BASE_URL MODEL
The Rust test tests/openai_client.rs starts the engine and asserts on this output.
"""

import json
import sys

import openai


def main() -> None:
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="levee-test", max_retries=0)

    out = {"openai_version": openai.__version__}

    models = client.models.list()
    out["models"] = [m.id for m in models.data]

    # Non-streaming chat.
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Why do rivers need levees?"}],
        max_tokens=6,
    )
    out["chat"] = {
        "content": resp.choices[0].message.content,
        "role": resp.choices[0].message.role,
        "finish_reason": resp.choices[0].finish_reason,
        "prompt_tokens": resp.usage.prompt_tokens,
        "completion_tokens": resp.usage.completion_tokens,
    }

    # Streaming chat with a final usage chunk.
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me about floods."}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage, chunks = [], None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            delta = chunk.choices[0].delta
            if delta.content:
                pieces.append(delta.content)
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    out["chat_stream"] = {
        "content": "".join(pieces),
        "content_chunks": len(pieces),
        "chunks": chunks,
        "finish_reason": finish,
        "completion_tokens": usage.completion_tokens if usage else None,
    }

    # Legacy completions, streaming.
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=5, stream=True
        )
        if c.choices
    )
    out["completion_stream"] = {"text": text}

    # An error maps to the SDK's exception with our error code.
    try:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
        out["not_found"] = None
    except openai.NotFoundError as e:
        out["not_found"] = e.code

    print(json.dumps(out))


if __name__ == "__main__":
    main()
