"""The official openai client against levee: a 429 becomes RateLimitError carrying our code,
and the client's built-in retry waits as our headers say.

Usage: python openai_client.py BASE_URL API_KEY
The gateway's per-IP guard must allow one request, then refuse the next for ~0.5 s.
"""
import sys
import time

import openai

base, key = sys.argv[1], sys.argv[2]
msgs = [{"role": "user", "content": "hi"}]

# 1. No retries: the 429 surfaces as RateLimitError with levee's code and headers.
c0 = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
c0.chat.completions.create(model="m", messages=msgs, max_tokens=4)
try:
    c0.chat.completions.create(model="m", messages=msgs, max_tokens=4)
    sys.exit("expected a RateLimitError")
except openai.RateLimitError as e:
    assert e.status_code == 429, e.status_code
    assert e.code == "rate_limit_exceeded", e.code
    assert e.type == "rate_limit_error", e.type
    ms = int(e.response.headers["retry-after-ms"])
    assert 0 < ms <= 500, ms
    assert int(e.response.headers["retry-after"]) == (ms + 999) // 1000
    print(f"RateLimitError code={e.code} retry-after-ms={ms}")

# 2. Built-in retry: record each attempt; the retry must come no sooner than retry-after-ms.
events = []


def on_request(request):
    events.append(("request", time.monotonic(), None))


def on_response(response):
    events.append(("response", time.monotonic(), response))


http = openai.DefaultHttpxClient(event_hooks={"request": [on_request], "response": [on_response]})
# Exhaust the IP budget first so the next call is refused and retried.
try:
    c0.chat.completions.create(model="m", messages=msgs, max_tokens=4)
except openai.RateLimitError:
    pass
c2 = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=3, http_client=http)
out = c2.chat.completions.create(model="m", messages=msgs, max_tokens=4)
assert out.choices[0].message.content is not None
responses = [e for e in events if e[0] == "response"]
requests = [e for e in events if e[0] == "request"]
assert responses[0][2].status_code == 429, [r[2].status_code for r in responses]
assert responses[-1][2].status_code == 200
told = int(responses[0][2].headers["retry-after-ms"]) / 1000.0
waited = requests[1][1] - responses[0][1]
# A sleep is never shorter than asked (allow 5 ms of clock/hook granularity).
assert waited >= told - 0.005, (waited, told)
print(f"retry waited {waited * 1000:.0f} ms, told {told * 1000:.0f} ms; attempts={len(requests)}")
print("OK")
