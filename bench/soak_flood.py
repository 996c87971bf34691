#!/usr/bin/env python3
"""The soak's flood (bench/soak.sh starts levee and the engines, then runs this).

Open-loop arrivals at --rate requests/s for --seconds, a mix of well-behaved and hostile
clients, each on a connection of its own, at most --max-outstanding at once (an arrival
over that is counted as skipped, never sent). Every --sample seconds it records levee's
RSS, open descriptors, open connections, in-flight and queued requests. At the end it
waits for levee to go idle and checks that every request sent has exactly one outcome in
levee_requests_total, and that RSS and descriptors stayed flat. Python standard library
only. Prints a JSON report and exits 1 when a check fails.
"""

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
import urllib.request

MIX = [
    # (class, weight)
    ("chat", 34),
    ("stream", 20),
    ("stream_cut", 8),
    ("leave_early", 6),
    ("bad_key", 8),
    ("malformed", 6),
    ("huge_n", 5),
    ("nested", 5),
    ("slow_body", 3),
    ("premium", 5),
]
IDLE_CONN_SHARE = 0.02  # of arrivals: a connection that sends nothing (not a request)


def body(extra=None, stream=False):
    v = {"model": "m", "max_tokens": 16, "stream": stream,
         "messages": [{"role": "user", "content": "soak " + "word " * random.randint(1, 60)}]}
    if extra:
        v.update(extra)
    return json.dumps(v).encode()


def request(path, key, payload, content_length=None):
    head = (f"POST {path} HTTP/1.1\r\nhost: levee\r\nconnection: close\r\n"
            f"content-type: application/json\r\n")
    if key:
        head += f"authorization: Bearer {key}\r\n"
    n = len(payload) if content_length is None else content_length
    head += f"content-length: {n}\r\n\r\n"
    return head.encode() + payload


def plan(cls, keys):
    """(bytes to send, how: 'full' | 'cut' | 'leave' | 'slow')."""
    key = random.choice(keys["standard"])
    if cls == "chat":
        return request("/v1/chat/completions", key, body()), "full"
    if cls == "premium":
        return request("/v1/chat/completions", keys["premium"][0], body()), "full"
    if cls == "stream":
        return request("/v1/chat/completions", key, body(stream=True)), "full"
    if cls == "stream_cut":
        return request("/v1/chat/completions", key, body({"max_tokens": 64}, stream=True)), "cut"
    if cls == "leave_early":
        return request("/v1/chat/completions", key, body({"max_tokens": 64})), "leave"
    if cls == "bad_key":
        return request("/v1/chat/completions", "sk-guess-" + str(random.randint(0, 1 << 30)), body()), "full"
    if cls == "malformed":
        return request("/v1/chat/completions", key, random.choice([b"{\"model\": ", b"[1,2]", b"\xff\xfe", b""])), "full"
    if cls == "huge_n":
        return request("/v1/chat/completions", key, body({"n": 100000})), "full"
    if cls == "nested":
        deep = b"{\"a\": " * 200 + b"1" + b"}" * 200
        payload = b"{\"model\": \"m\", \"messages\": [], \"x\": " + deep + b"}"
        return request("/v1/chat/completions", key, payload), "full"
    if cls == "slow_body":
        payload = body()
        return request("/v1/chat/completions", key, payload[:10], content_length=len(payload)), "slow"
    raise ValueError(cls)


class Flood:
    def __init__(self, args):
        self.args = args
        self.host, port = args.target.rsplit(":", 1)
        self.port = int(port)
        self.keys = {"standard": args.keys.split(","), "premium": [args.premium_key]}
        self.sent = 0
        self.skipped = 0
        self.idle_conns = 0
        self.outstanding = 0
        self.by_class = {}
        self.by_result = {"served": 0, "refused": 0, "rejected": 0, "failed": 0, "left": 0}
        self.statuses = {}

    def note(self, cls, result, status=None):
        self.by_class.setdefault(cls, {}).setdefault(result, 0)
        self.by_class[cls][result] += 1
        self.by_result[result] += 1
        if status is not None:
            self.statuses[status] = self.statuses.get(status, 0) + 1

    async def one(self, cls):
        data, how = plan(cls, self.keys)
        self.outstanding += 1
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 10)
        except Exception:
            self.outstanding -= 1
            self.sent += 1
            self.note(cls, "failed")
            return
        self.sent += 1
        try:
            w.write(data)
            await w.drain()
            if how == "leave":
                w.close()
                self.note(cls, "left")
                return
            line = await asyncio.wait_for(r.readline(), 120)
            m = re.match(rb"HTTP/1\.1 (\d{3})", line)
            status = int(m.group(1)) if m else 0
            if how == "cut" and status == 200:
                await asyncio.wait_for(r.readuntil(b"data:"), 60)
                w.close()
                self.note(cls, "left", status)
                return
            await asyncio.wait_for(r.read(), 120)
            if 200 <= status < 300:
                self.note(cls, "served", status)
            elif status in (429, 503):
                self.note(cls, "refused", status)
            elif 400 <= status < 500:
                self.note(cls, "rejected", status)
            else:
                self.note(cls, "failed", status)
        except Exception:
            self.note(cls, "failed")
        finally:
            self.outstanding -= 1
            try:
                w.close()
            except Exception:
                pass

    async def idle(self):
        self.idle_conns += 1
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 10)
            if random.random() < 0.5:
                w.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            await asyncio.sleep(random.uniform(0.5, 3.0))
            w.close()
        except Exception:
            pass

    async def run(self, sampler):
        classes = [c for c, _ in MIX]
        weights = [w for _, w in MIX]
        interval = 1.0 / self.args.rate
        start = time.monotonic()
        next_at = start
        tasks = set()
        while time.monotonic() - start < self.args.seconds:
            now = time.monotonic()
            if now < next_at:
                await asyncio.sleep(next_at - now)
            next_at += random.expovariate(1.0 / interval)
            if random.random() < IDLE_CONN_SHARE:
                t = asyncio.create_task(self.idle())
            elif self.outstanding >= self.args.max_outstanding:
                self.skipped += 1
                continue
            else:
                t = asyncio.create_task(self.one(random.choices(classes, weights)[0]))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            sampler.maybe(time.monotonic() - start, self)
        await asyncio.gather(*tasks, return_exceptions=True)


def get(url, token=None):
    req = urllib.request.Request(url, headers={"host": "127.0.0.1"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def metric_sum(text, name):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric_by(text, name, label):
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            m = re.search(label + r'="([^"]*)"', line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0) + float(line.rsplit(" ", 1)[1])
    return out


class Sampler:
    def __init__(self, args):
        self.args = args
        self.samples = []
        self.next = 0.0

    def proc(self):
        pid = self.args.pid
        rss = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) // 1024
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return rss, fds

    def take(self, t, flood=None):
        rss, fds = self.proc()
        state = json.loads(get(self.args.admin + "/admin/state"))
        text = get(self.args.admin + "/metrics")
        s = {"t_s": round(t, 1), "rss_mb": rss, "fds": fds,
             "open_connections": metric_by(text, "levee_open_connections", "listener").get("public", 0),
             "in_flight": state["in_flight"], "queued": state["queued"],
             "requests_total": metric_sum(text, "levee_requests_total")}
        if flood:
            s["sent"] = flood.sent
            s["outstanding"] = flood.outstanding
        self.samples.append(s)
        print(json.dumps(s), file=sys.stderr, flush=True)
        return s

    def maybe(self, t, flood):
        if t >= self.next:
            self.next = t + self.args.sample
            try:
                self.take(t, flood)
            except Exception as e:  # a sample lost is reported, never fatal
                print(f"sample failed: {e}", file=sys.stderr)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True, help="public listener host:port")
    ap.add_argument("--admin", required=True, help="admin base URL")
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--keys", required=True, help="standard tenants' API keys, comma-separated")
    ap.add_argument("--premium-key", required=True)
    ap.add_argument("--rate", type=float, default=150.0)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--max-outstanding", type=int, default=400)
    ap.add_argument("--sample", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=60.0)
    ap.add_argument("--upstream-pool", type=int, default=16,
                    help="idle upstream connections levee may keep (sum of max_in_flight)")
    args = ap.parse_args()
    sampler = Sampler(args)
    baseline = sampler.take(0.0)
    flood = Flood(args)
    t0 = time.monotonic()
    await flood.run(sampler)
    flood_s = time.monotonic() - t0
    sampler.take(flood_s, flood)
    # Idle: nothing in flight or queued, every connection closed (idle ones time out).
    deadline = time.monotonic() + 120
    while True:
        s = sampler.take(time.monotonic() - t0, flood)
        if (s["in_flight"] == 0 and s["queued"] == 0 and s["open_connections"] == 0
                and s["requests_total"] - baseline["requests_total"] >= flood.sent) \
                or time.monotonic() > deadline:
            break
        await asyncio.sleep(2)
    final = sampler.samples[-1]
    text = get(args.admin + "/metrics")
    outcomes = metric_by(text, "levee_requests_total", "outcome")
    counted = final["requests_total"] - baseline["requests_total"]
    during = [s for s in sampler.samples if args.warmup <= s["t_s"] <= flood_s and "sent" in s]
    if not during:
        during = [s for s in sampler.samples if "sent" in s]
    third = max(1, len(during) // 3)
    rss_early = median([s["rss_mb"] for s in during[:third]])
    rss_late = median([s["rss_mb"] for s in during[-third:]])
    fds_early = median([s["fds"] for s in during[:third]])
    fds_late = median([s["fds"] for s in during[-third:]])
    report = {
        "duration_s": round(flood_s, 1),
        "offered_rate_per_s": args.rate,
        "sent": flood.sent,
        "skipped_at_client_cap": flood.skipped,
        "idle_connections_opened": flood.idle_conns,
        "client_view": flood.by_result,
        "by_class": flood.by_class,
        "statuses": flood.statuses,
        "levee_requests_total": counted,
        "levee_outcomes": outcomes,
        "rss_mb": {"baseline": baseline["rss_mb"], "early_median": rss_early,
                   "late_median": rss_late, "max": max(s["rss_mb"] for s in sampler.samples),
                   "end": final["rss_mb"]},
        "fds": {"baseline": baseline["fds"], "early_median": fds_early, "late_median": fds_late,
                "max": max(s["fds"] for s in sampler.samples), "end": final["fds"]},
        "end_state": {k: final[k] for k in ("in_flight", "queued", "open_connections")},
        "samples": sampler.samples,
    }
    checks = {
        "every request sent has one outcome (levee_requests_total = sent)": counted == flood.sent,
        "client view adds up (served + refused + rejected + failed + left = sent)":
            sum(flood.by_result.values()) == flood.sent,
        "idle at the end (in flight, queued, open connections = 0)":
            final["in_flight"] == 0 and final["queued"] == 0 and final["open_connections"] == 0,
        # Idle keep-alive connections to the engines stay pooled: up to --upstream-pool.
        "descriptors flat (late median <= early + 8) and back near baseline at the end":
            fds_late <= fds_early + 8
            and final["fds"] <= baseline["fds"] + args.upstream_pool + 4,
        "RSS flat (late median within 25% + 8 MB of early)":
            rss_late <= rss_early * 1.25 + 8,
    }
    report["checks"] = checks
    print(json.dumps(report, indent=1))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    asyncio.run(main())
