"""Reliability of a real `mlxd serve`, as figures: head-of-line gap, stalled readers, a soak with
clients leaving, kill -9 recovery and SIGTERM exit.

Starts `mlxd serve` on loopback (the embedded SmolLM2, or --model) with an explicit KV pool and
runs five phases against it, each with a timeout of its own (a phase that runs out or fails is
reported as such, and the next one runs):

  hol      4 streamed chats decode (greedy, ignore_eos); then a fresh ~7K-token prompt arrives.
           Each stream's longest inter-token gap in steady decoding before the arrival and from
           it on (until 32 tokens after the long prompt's first), and the long prompt's time to
           first token.
  stalled  4 streamed chats alone, then the same beside 20 streamed requests whose clients send
           the request and never read (raw sockets, 4 KB receive buffer): tokens/s and ITL
           p50/p99 of the 4, the engine's running count meanwhile, and how long after the 20
           hang up (close with unread data: a reset) the engine is idle with every block free.
  soak     500 requests, 16 at a time, of random lengths, streamed or not; half the clients
           leave at a random point (after k tokens, or after t seconds, which may be before the
           answer starts). RSS of the gateway (serve itself) and the engine, and free KV blocks,
           before and after; answers by kind; wall time.
  kill9    SIGKILL the engine (serve's child) with streams in flight: how they ended, and the
           time until a chat is answered again by the engine serve starts in its place.
  sigterm  SIGTERM `mlxd serve` (the main process, as launchd or a container runtime sends it)
           with streams in flight: time until its whole process tree has exited, and how each
           stream ended.

The engine's figures come from /health?fresh=1 (running, waiting, free blocks, preemptions,
prefix-cache hits). Every prompt is fresh: a random tag, then random words, so only the chat
template's opening can come from the prefix cache (each phase reports its hits). Random choices
come from --seed; timing decides the rest. A quiet machine gives figures worth keeping; --quick
scales everything down for a smoke run.

    python -m bench.reliability [--model PATH] [--quick] [--seed 0] [--out FILE.md]

Over 400 lines because the five phases share one served engine, its health readings and one report,
and each phase is short.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
import psutil

from mlxd.bench.agent.peers import tree_rss
from mlxd.bench.agent.report import machine
from tests.e2e.serve_harness import Serve


@dataclass(frozen=True)
class Sizes:
    long_prompt: int = 7000      # tokens of the prompt that arrives in hol
    hol_tokens: int = 1024       # max_tokens of hol's streams (they leave earlier, see hol_after)
    hol_warm: int = 16           # hol's streams decode 2 x this many tokens before the long prompt is sent
    hol_after: int = 32          # tokens each hol stream reads after the long prompt's first
    normal_tokens: int = 256     # max_tokens of stalled's 4 normal streams
    stalled: int = 20
    soak: int = 500
    soak_concurrency: int = 16
    soak_max_tokens: int = 64
    inflight: int = 8            # streams in flight at kill -9 and at SIGTERM
    kv_blocks: int = 1024        # fits hol (4 streams + the long prompt) and stalled (24 streams)


QUICK = Sizes(long_prompt=1000, hol_tokens=128, hol_warm=4, hol_after=8, normal_tokens=24, soak=40,
              soak_concurrency=8, soak_max_tokens=16, inflight=4, kv_blocks=384)
STREAMS = 4  # the normal streams of hol and stalled

_WORDS = ("amber basin cedar delta ember fjord garnet harbor island juniper kettle lantern meadow "
          "nectar orchard pebble quarry ridge saddle timber upland valley willow yarrow zephyr "
          "anchor beacon canyon dune estuary falcon glacier heron inlet jasper kelp lagoon marsh "
          "north osprey prairie quartz reef summit tundra umber vapor wharf").split()


@dataclass
class Stream:
    """One chat request as its client saw it (times on time.perf_counter's clock)."""
    sent: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each chunk that carries content
    tokens: int = 0                                   # completion_tokens of the usage chunk
    prompt_tokens: int = 0
    # done, left (the client went, as planned), error_event (the stream carried an error),
    # cut (ended without [DONE]), http_NNN, or the transport exception's name (a reset).
    end: str = ""
    ended: float = 0.0
    error: str = ""


def _after_tokens(k: int):
    """A client that hangs up once it has read ``k`` tokens."""
    return lambda s: len(s.times) >= k


def gaps_ms(times: list[float]) -> list[float]:
    return [1000 * (b - a) for a, b in zip(times, times[1:])]


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 1) if xs else None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                              text=True).stdout.strip() or platform.processor()
    except OSError:
        return platform.processor()


def open_stalled(port: int, body: dict) -> socket.socket:
    """A client that sends a streamed request and never reads its answer."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (port, len(payload)) + payload)
    return s


class Bench:
    def __init__(self, serve: Serve, http: httpx.AsyncClient, sizes: Sizes, seed: int, shutdown_timeout: float):
        self.serve, self.http, self.sizes = serve, http, sizes
        self.url = serve.url
        self.rng = random.Random(seed)
        self.shutdown_timeout = shutdown_timeout

    # -- requests -------------------------------------------------------------------------------

    def messages(self, words: int) -> list[dict]:
        """A fresh prompt: a random tag (no two prompts share their first block), then random words."""
        text = f"Note {self.rng.getrandbits(64):016x}. " + " ".join(self.rng.choices(_WORDS, k=words))
        return [{"role": "user", "content": text}]

    async def long_messages(self, tokens: int) -> list[dict]:
        """A fresh prompt of about ``tokens`` tokens, its length scaled from a counted sample."""
        sample = self.messages(1000)
        r = await self.http.post(self.url + "/tokenize", json={"messages": sample})
        r.raise_for_status()
        return self.messages(max(1, round(1000 * tokens / r.json()["count"])))

    async def chat(self, s: Stream, messages: list[dict], max_tokens: int, *, stream: bool = True,
                   leave=None, leave_after_s: float | None = None) -> Stream:
        """Send one chat and fill ``s``; ``leave(s)``, asked after each token, or ``leave_after_s``
        seconds make the client hang up."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
        s.sent = time.perf_counter()
        try:
            async with asyncio.timeout(leave_after_s):
                if stream:
                    async with self.http.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
                        if r.status_code != 200:
                            s.end, s.error = f"http_{r.status_code}", (await r.aread())[:200].decode(errors="replace")
                        else:
                            s.end = await self._read_events(r, s, leave)
                else:
                    r = await self.http.post(self.url + "/v1/chat/completions", json=body)
                    if r.status_code != 200:
                        s.end, s.error = f"http_{r.status_code}", r.text[:200]
                    else:
                        s.times.append(time.perf_counter())
                        s.tokens = r.json()["usage"]["completion_tokens"]
                        s.end = "done"
        except TimeoutError:
            s.end = "left"
        except httpx.HTTPError as e:
            s.end, s.error = type(e).__name__, str(e)[:200]
        s.ended = time.perf_counter()
        return s

    @staticmethod
    async def _read_events(r: httpx.Response, s: Stream, leave) -> str:
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "error_event" if s.error else "done"
            chunk = json.loads(line[6:])
            if "error" in chunk:
                s.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                continue
            if chunk.get("usage"):
                s.tokens, s.prompt_tokens = chunk["usage"]["completion_tokens"], chunk["usage"]["prompt_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
                s.times.append(time.perf_counter())
                if leave is not None and leave(s):
                    return "left"
        return "error_event" if s.error else "cut"

    async def until_tokens(self, streams: list[Stream], n: int, tasks) -> None:
        """Until each stream has ``n`` tokens or has ended."""
        while any(len(s.times) < n and not t.done() for s, t in zip(streams, tasks)):
            await asyncio.sleep(0.01)

    # -- the engine and the processes --------------------------------------------------------------

    async def stats(self) -> dict | None:
        """The engine's stats (/health?fresh=1), None while it does not serve."""
        try:
            r = await self.http.get(self.url + "/health?fresh=1", timeout=10)
        except httpx.HTTPError:
            return None
        return r.json().get("engine") if r.status_code == 200 else None

    async def wait_idle(self, free: int | None = None, timeout: float = 120.0) -> tuple[float | None, dict | None]:
        """(seconds until the engine runs and queues nothing, with ``free`` blocks free if given, or None
        if not within ``timeout``; the last stats seen)."""
        t0 = time.perf_counter()
        last = None
        while time.perf_counter() - t0 < timeout:
            last = await self.stats() or last
            if last and not last["num_running"] and not last["num_waiting"] and (
                    free is None or last["num_free_blocks"] == free):
                return round(time.perf_counter() - t0, 2), last
            await asyncio.sleep(0.05)
        return None, last

    def rss_mb(self) -> dict:
        total, engine = tree_rss(self.serve.proc.pid), tree_rss(self.serve.engine_pid())
        return {"gateway": round((total - engine) / 2**20), "engine": round(engine / 2**20)}

    # -- the phases ---------------------------------------------------------------------------

    async def hol(self) -> dict:
        z = self.sizes
        long_msgs = await self.long_messages(z.long_prompt)
        before = await self.stats()
        mark: dict[str, float] = {}

        def leave(s: Stream) -> bool:
            first = mark.get("first")
            return first is not None and len(s.times) - bisect.bisect_right(s.times, first) >= z.hol_after

        streams = [Stream() for _ in range(STREAMS)]
        tasks = [asyncio.create_task(self.chat(s, self.messages(48), z.hol_tokens, leave=leave)) for s in streams]
        # Steady decoding (every stream past its prefill) for hol_warm tokens, then the arrival.
        await self.until_tokens(streams, z.hol_warm, tasks)
        steady = time.perf_counter()
        await self.until_tokens(streams, 2 * z.hol_warm, tasks)
        arrived = time.perf_counter()
        long = await self.chat(Stream(), long_msgs, 4)
        mark["first"] = long.times[0] if long.times else time.perf_counter()
        await asyncio.gather(*tasks)
        after = await self.stats()
        before_gaps = [gaps_ms([t for t in s.times if steady <= t < arrived]) for s in streams]
        during_gaps = [[1000 * (b - a) for a, b in zip(s.times, s.times[1:]) if b >= arrived] for s in streams]
        return {
            "long_prompt_tokens": long.prompt_tokens, "long_ttft_s": round(mark["first"] - long.sent, 3),
            "long_end": long.end,
            "itl_p50_before_ms": pct(sum(before_gaps, []), 50),
            "max_gap_before_ms": [pct(g, 100) for g in before_gaps],
            "max_gap_from_arrival_ms": [pct(g, 100) for g in during_gaps],
            "stream_ends": [s.end for s in streams],
            "prefix_cache_hit_tokens": after["prefix_cache_hits"] - before["prefix_cache_hits"],
            "preemptions": after["num_preemptions"] - before["num_preemptions"],
        }

    async def normal_streams(self) -> dict:
        streams = [Stream() for _ in range(STREAMS)]
        await asyncio.gather(*(self.chat(s, self.messages(48), self.sizes.normal_tokens) for s in streams))
        wall = max(s.ended for s in streams) - min(s.sent for s in streams)
        gaps = sum((gaps_ms(s.times) for s in streams), [])
        return {"tok_s": round(sum(s.tokens for s in streams) / wall, 1), "itl_p50_ms": pct(gaps, 50),
                "itl_p99_ms": pct(gaps, 99), "ends": dict(Counter(s.end for s in streams))}

    async def stalled(self) -> dict:
        z = self.sizes
        _, idle = await self.wait_idle()
        alone = await self.normal_streams()
        # Long enough to outlast the normal streams, short enough for the pool to hold them all.
        body = {"messages": None, "max_tokens": 2 * z.normal_tokens + 64, "temperature": 0, "ignore_eos": True,
                "stream": True}
        socks = []
        try:
            for _ in range(z.stalled):
                socks.append(open_stalled(self.serve.port, {**body, "messages": self.messages(48)}))
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 60:
                st = await self.stats()
                if st and st["num_running"] >= z.stalled:
                    break
                await asyncio.sleep(0.05)
            beside = await self.normal_streams()
            held = await self.stats()
        finally:
            for s in socks:
                s.close()
        back_s, last = await self.wait_idle(free=idle["num_free_blocks"], timeout=300)
        return {
            "alone": alone, "beside_stalled": beside,
            "running_while_stalled_open": held["num_running"], "waiting_while_stalled_open": held["num_waiting"],
            "idle_with_all_blocks_free_after_hangup_s": back_s,
            "free_blocks": [idle["num_free_blocks"], last["num_free_blocks"]],
            "running_at_end": last["num_running"], "waiting_at_end": last["num_waiting"],
            "preemptions": last["num_preemptions"] - idle["num_preemptions"],
        }

    async def soak(self) -> dict:
        z = self.sizes
        _, before = await self.wait_idle()
        rss0 = self.rss_mb()
        pid0 = self.serve.engine_pid()
        leavers = set(self.rng.sample(range(z.soak), z.soak // 2))
        plan = []
        for i in range(z.soak):
            stream = self.rng.random() < 0.75
            leave = leave_s = None
            if i in leavers:
                if stream and self.rng.random() < 0.5:
                    leave = _after_tokens(self.rng.randint(1, z.soak_max_tokens))
                else:
                    leave_s = self.rng.uniform(0.0, 1.0)
            plan.append(dict(messages=self.messages(self.rng.randint(8, 160)),
                             max_tokens=self.rng.randint(4, z.soak_max_tokens), stream=stream, leave=leave,
                             leave_after_s=leave_s))
        gate = asyncio.Semaphore(z.soak_concurrency)

        async def one(request: dict) -> Stream:
            async with gate:
                return await self.chat(Stream(), **request)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in plan))
        wall = time.perf_counter() - t0
        idle_s, after = await self.wait_idle(free=before["num_free_blocks"], timeout=300)
        after = after or {}
        return {
            "requests": z.soak, "concurrency": z.soak_concurrency, "clients_leaving": len(leavers),
            "wall_s": round(wall, 1), "ends": dict(Counter(s.end for s in results)),
            "5xx": sum(s.end.startswith("http_5") for s in results),
            "errors_seen": sorted({s.error for s in results if s.error})[:5],
            "idle_with_all_blocks_free_after_s": idle_s,
            "free_blocks": [before["num_free_blocks"], after.get("num_free_blocks")],
            "total_blocks": before["num_total_blocks"],
            "running_waiting_at_end": [after.get("num_running"), after.get("num_waiting")],
            "rss_mb_before": rss0, "rss_mb_after": self.rss_mb(),
            "engine_restarted": self.serve.engine_pid() != pid0,
            "prefix_cache_hit_tokens": after.get("prefix_cache_hits", 0) - before["prefix_cache_hits"],
            "preemptions": after.get("num_preemptions", 0) - before["num_preemptions"],
        }

    async def inflight(self) -> tuple[list[Stream], list[asyncio.Task]]:
        """``sizes.inflight`` streams that will not end by themselves soon, each past its first token."""
        z = self.sizes
        # As long as the pool holds them all (blocks of 16 tokens, the default): no preemption.
        max_tokens = z.kv_blocks * 16 // z.inflight - 128
        streams = [Stream() for _ in range(z.inflight)]
        tasks = [asyncio.create_task(self.chat(s, self.messages(48), max_tokens)) for s in streams]
        await self.until_tokens(streams, 1, tasks)
        return streams, tasks

    async def kill9(self) -> dict:
        await self.wait_idle()
        old = self.serve.engine_pid()
        streams, tasks = await self.inflight()
        os.kill(old, signal.SIGKILL)
        killed = time.perf_counter()
        seen: Counter = Counter()
        while True:
            probe = await self.chat(Stream(), self.messages(16), 4, stream=False)
            if probe.end == "done" and probe.tokens:
                break
            seen[probe.end] += 1
            await asyncio.sleep(0.05)
        recovered = probe.ended - killed
        await asyncio.gather(*tasks)
        return {"first_good_answer_after_s": round(recovered, 2), "answers_before": dict(seen),
                "new_engine": self.serve.engine_pid() != old,
                "inflight_ends": dict(Counter(s.end for s in streams)),
                "inflight_ended_after_s": round(max(s.ended for s in streams) - killed, 2),
                "inflight_errors": sorted({s.error for s in streams if s.error})[:3]}

    async def sigterm(self) -> dict:
        await self.wait_idle()
        streams, tasks = await self.inflight()
        root = psutil.Process(self.serve.proc.pid)
        tree = [root, *root.children(recursive=True)]
        os.kill(root.pid, signal.SIGTERM)
        t0 = time.perf_counter()

        def gone(p: psutil.Process) -> bool:
            if p is root:
                return self.serve.proc.poll() is not None
            try:
                return p.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        while not all(gone(p) for p in tree):
            await asyncio.sleep(0.02)
        exited = time.perf_counter() - t0
        await asyncio.gather(*tasks)
        return {"shutdown_timeout_s": self.shutdown_timeout, "processes": len(tree),
                "tree_exited_after_s": round(exited, 2), "serve_exit_code": self.serve.proc.returncode,
                "stream_ends": dict(Counter(s.end for s in streams)),
                "streams_ended_after_s": [round(min(s.ended for s in streams) - t0, 2),
                                          round(max(s.ended for s in streams) - t0, 2)],
                "stream_errors": sorted({s.error for s in streams if s.error})[:3]}


PHASES = ("hol", "stalled", "soak", "kill9", "sigterm")


async def run_phases(bench: Bench, timeout: float) -> list[dict]:
    # Warm-up, untimed: the first requests of a fresh engine pay for first-use work.
    for _ in range(2):
        await bench.chat(Stream(), bench.messages(32), 8)
    records = []
    for name in PHASES:
        t0 = time.perf_counter()
        try:
            rec = await asyncio.wait_for(getattr(bench, name)(), timeout)
        except TimeoutError:
            rec = {"error": f"did not end within {timeout:.0f} s"}
        except Exception as e:  # a phase that fails is a figure too; the next one still runs
            rec = {"error": f"{type(e).__name__}: {e}"}
        records.append({"phase": name, **rec, "phase_s": round(time.perf_counter() - t0, 1)})
        print(json.dumps(records[-1]), flush=True)
    return records


def markdown(header: dict, records: list[dict]) -> str:
    m = header["machine"]
    lines = [
        "# Reliability of `mlxd serve`",
        "",
        f"Machine: {m['cpu_model']}, {m['cpus']} logical cores ({m['physical_cores']} physical), "
        f"{m['ram_gib']} GiB RAM, {m['platform']}; python {m['python']}, mlx {m.get('mlx', '?')}, "
        f"mlx-lm {m.get('mlx-lm', '?')}, MLX device {header['device']}.",
        f"mlxd {header['commit']}, model {header['model']}, seed {header['seed']}, {header['date']}.",
        f"`mlxd serve {' '.join(header['serve_flags'])}`",
        f"Sizes: {json.dumps(header['sizes'])}",
        "",
        "| phase | figure | value |",
        "|---|---|---|",
    ]
    for rec in records:
        for key, value in rec.items():
            if key != "phase":
                lines.append(f"| {rec['phase']} | {key} | {value if isinstance(value, str) else json.dumps(value)} |")
    lines += ["", "```jsonl", *(json.dumps(r) for r in [header, *records]), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="default: the embedded SmolLM2")
    ap.add_argument("--quick", action="store_true", help="everything scaled down, for a smoke run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--soak", type=int, help="soak requests (default 500, --quick 40)")
    ap.add_argument("--concurrency", type=int, help="soak requests at once (default 16, --quick 8)")
    ap.add_argument("--num-kv-blocks", type=int, help="KV pool (default 1024, --quick 384)")
    ap.add_argument("--max-num-seqs", type=int, help="default: the device's")
    ap.add_argument("--max-num-batched-tokens", type=int, help="default: the device's (it bounds the hol gap)")
    ap.add_argument("--shutdown-timeout", type=float, help="default: mlxd's")
    ap.add_argument("--serve-flags", default="", help="more `mlxd serve` flags, one string")
    ap.add_argument("--phase-timeout", type=float, default=900.0, help="seconds each phase may take")
    ap.add_argument("--out", type=Path, help="markdown file (default: print)")
    args = ap.parse_args(argv)

    from mlxd.engined.device import device_kind
    from mlxd.shared.config import DEVICE_DEFAULTS
    from mlxd.shared.serve_config import DaemonConfig

    sizes = QUICK if args.quick else Sizes()
    sizes = replace(sizes, soak=args.soak or sizes.soak, soak_concurrency=args.concurrency or sizes.soak_concurrency,
                    kv_blocks=args.num_kv_blocks or sizes.kv_blocks)
    device = device_kind()
    shutdown_timeout = DaemonConfig().shutdown_timeout if args.shutdown_timeout is None else args.shutdown_timeout
    # Explicit, so that the table says what ran (Serve's own small test flags come first and are overridden).
    flags = ["--num-kv-blocks", str(sizes.kv_blocks), "--max-model-len", "8192",
             "--max-num-seqs", str(args.max_num_seqs or DEVICE_DEFAULTS[device]["max_num_seqs"]),
             "--max-num-batched-tokens",
             str(args.max_num_batched_tokens or DEVICE_DEFAULTS[device]["max_num_batched_tokens"]),
             "--shutdown-timeout", str(shutdown_timeout), *(["--model", args.model] if args.model else []),
             *shlex.split(args.serve_flags)]
    vm = psutil.virtual_memory()
    header = {
        "machine": {**machine(), "cpu_model": cpu_model(), "physical_cores": psutil.cpu_count(logical=False),
                    "ram_gib": round(vm.total / 2**30, 1)},
        "device": device, "model": args.model or "SmolLM2 (embedded)", "seed": args.seed, "serve_flags": flags,
        "sizes": asdict(sizes), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=Path(__file__).parent).stdout.strip() or "?",
    }
    print(f"seed {args.seed}; " + json.dumps(header), flush=True)

    serve = Serve(Path(tempfile.mkdtemp(prefix="mlxd-rel-")), *flags)
    try:
        serve.start().wait_healthy(timeout=600)

        async def go() -> list[dict]:
            async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10),
                                         limits=httpx.Limits(max_connections=128)) as http:
                return await run_phases(Bench(serve, http, sizes, args.seed, shutdown_timeout), args.phase_timeout)

        records = asyncio.run(go())
    finally:
        serve.stop(graceful=True)
    log = serve.log()
    records.append({"phase": "log", "tracebacks": log.count("Traceback"),
                    "error_lines": sum(" ERROR " in line for line in log.splitlines()), "path": str(serve.log_path)})
    text = markdown(header, records)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
