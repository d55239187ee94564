"""End to end over HTTP: `mlxd serve` against `mlx_lm.server` on one checkpoint, Poisson arrivals, fresh prompts.

For each weight format (bf16, and 4-bit in groups of 64 as ``bench.gpu_serving.build_models`` quantizes)
a random-weight checkpoint of a real shape (``bench.gpu_serving.SHAPES``, Qwen3-8B by default) is written
once under ``--dir`` with mlx_lm's own save functions and a byte-level tokenizer. Each server is then
started alone on it, as a user starts it (``mlxd serve`` with its GPU defaults, ``mlx_lm server`` with
its defaults, batching on), and stopped, its processes gone and the GPU's memory back, before the other
starts. At each ``--rates`` arrival rate it is sent a few untimed warm-up requests, then ``--num-prompts``
streamed greedy ``/v1/completions`` requests at Poisson times (open loop): mixed prompts, uniform in
``--prompt-lens`` tokens, ``--max-tokens`` generated each. Both servers get the same prompts at the same
times for a rate and format (each is a new process: no cache carries over); within one server's run every
prompt is new to it (warm-up and each rate draw their own seeds), so ``cached_tokens`` counts only what
prompts share by chance: a first few letters for mlx_lm's cache, which matches any common prefix, never a
whole 16-token block for mlxd's.

Completions rather than chat: the prompt reaches both models as exactly its text, no template between.
A prompt is random lowercase words; the tokenizer has no merges, so n ASCII characters are n tokens on
both servers (checked against ``usage.prompt_tokens``). The model's output rows for the bytes and the
special tokens are zero, so a greedy pick is always a word token (" w<i>"): no end token stops a request
early, and every token streams as one word, which the client counts per chunk for the inter-token
latency (a chunk of k tokens k gaps of a k-th of its wait; TPOT, a request's mean gap, beside it).
Per request the client checks the generated count against ``usage.completion_tokens`` and ``--max-tokens``.

Reported per server x format x rate: requests completed / failed / short, cached tokens, TTFT and
inter-token latency p50/p90/p99, total tokens/s (prompt + generated, first send to last finish) and
output tokens/s; then mlxd / mlx_lm for total tokens/s and TTFT p50 and p99. Every phase has a time limit
inside ``--budget-s``; rows are written as they come (``gpu_http.jsonl``, ``gpu_http.md`` in ``--out``).

    python -m bench.gpu_http --rates 2,8 --num-prompts 32,64 --out bench/results/gpu_http  # within --budget-s

Over 400 lines because the checkpoint, both servers' lives, the open-loop client and the report are
one run whose phases share their time limits and the same prompts; each part alone is a screen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from mlxd.bench.agent import peers

SERVERS = ("mlxd", "mlx_lm")
FORMATS = ("bf16", "q4")
FIRST_WORD = 259  # ids below: the 256 bytes and the three specials, never picked (their output rows are zero)
WORD = re.compile(r"w\d+")


def write_tokenizer(out: Path, vocab_size: int, context: int) -> None:
    """Bytes, the ChatML specials, then ordinary words (" w<i>") up to ``vocab_size``: prompts encode
    to bytes, and any id a random model samples decodes to text."""
    from tests import tiny_models

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = tiny_models.byte_chars() + specials
    special = [False] * 256 + [True] * len(specials)
    words = vocab_size - len(tokens)
    tiny_models.write_tokenizer(out, tokens + [f"Ġw{i}" for i in range(words)], [], special + [False] * words,
                                "<|endoftext|>", "<|im_end|>", context)


def write_checkpoint(shape: str, fmt: str, seed: int, out: Path) -> None:
    """A random-weight checkpoint of ``shape`` in mlx_lm's layout that both servers load; run in a process
    of its own, so that its arrays leave the device before a server starts."""
    from mlx_lm.utils import save_config, save_model

    from mlxd.bench.gpu_serving import SHAPES, build_models

    model, _, _ = build_models(shape, fmt, seed)
    for name in ("weight",) if fmt == "bf16" else ("scales", "biases"):
        getattr(model.lm_head, name)[:FIRST_WORD] = 0  # logit 0: below the best of the random word logits
    save_model(out, model)
    config = dict(SHAPES[shape], bos_token_id=256, eos_token_id=258)
    if fmt == "q4":
        config["quantization"] = {"group_size": 64, "bits": 4}
    write_tokenizer(out, config["vocab_size"], config["max_position_embeddings"])
    save_config(config, out / "config.json")  # last: its presence marks a whole checkpoint


def checkpoint(args, fmt: str, timeout: float) -> Path:
    out = Path(args.dir) / f"{args.model}-{fmt}-seed{args.seed}"
    if (out / "config.json").exists():
        return out
    t0 = time.monotonic()
    proc = multiprocessing.get_context("spawn").Process(target=write_checkpoint, args=(args.model, fmt, args.seed, out),
                                                        daemon=True)  # dies with this process if it is stopped
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise TimeoutError(f"writing the {fmt} checkpoint took more than {timeout:.0f}s")
    if proc.exitcode != 0:
        raise RuntimeError(f"writing the {fmt} checkpoint failed (exit code {proc.exitcode})")
    print(f"{fmt} checkpoint written to {out} in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    return out


def draw_seed(seed: int, *keys: int) -> int:
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0])


def prompt_texts(seed: int, n: int, lo: int, hi: int) -> list[str]:
    """``n`` prompts of random lowercase words, lengths uniform in ``lo``..``hi`` characters (= tokens)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    out = []
    for length in rng.integers(lo, hi + 1, n):
        chars = letters[rng.integers(0, 26, length)]
        chars[1:][rng.random(length - 1) < 0.18] = " "
        out.append("".join(chars))
    return out


def arrivals(seed: int, n: int, rate: float) -> list[float]:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()


class MlxLmServer(peers.Server):
    """``mlx_lm server`` as its documentation starts it: batched decoding and its prompt cache at their defaults."""
    name = "mlx_lm"
    ready_path = "/health"  # its /v1/models scans the Hugging Face cache

    def __init__(self, log_dir: Path, model_dir: Path, extra: list[str]):
        super().__init__(log_dir, 0)
        self.model_dir, self.extra = model_dir, extra

    def model_name(self) -> str:
        return str(self.model_dir)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "mlx_lm", "server", "--model", str(self.model_dir), "--host", "127.0.0.1",
                "--port", str(self.port), "--log-level", "WARNING", *self.extra]


def launch(name: str, ckpt: Path, args, log_dir: Path) -> peers.Server:
    if name == "mlxd":
        return peers.Mlxd(log_dir, 0, str(ckpt), ["--max-model-len", str(args.max_model_len),
                                                  *shlex.split(args.mlxd_args)])
    return MlxLmServer(log_dir, ckpt, shlex.split(args.mlx_lm_args))


def gpu_memory_mib() -> int | None:
    """Memory in use on the first GPU (nvidia-smi), None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, timeout=20)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None


def _live_in_group(pgid: int) -> int:
    """Processes of process group ``pgid`` that still run (zombies, already dead, do not count)."""
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            n += fields[0] != "Z" and int(fields[2]) == pgid
    return n


def stop_alone(server: peers.Server, idle_mib: int | None, timeout: float) -> dict:
    """Stop ``server`` and wait until its process group is gone and the GPU's memory is back to ``idle_mib``
    (within 1 GiB), so that the next server has the device to itself."""
    t0 = time.monotonic()
    server.stop()
    if server.proc is None:
        return {}
    pgid, deadline = server.proc.pid, t0 + timeout
    while _live_in_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _live_in_group(pgid):
        os.killpg(pgid, signal.SIGKILL)
    used = gpu_memory_mib()
    while used is not None and idle_mib is not None and used > idle_mib + 1024 and time.monotonic() < deadline:
        time.sleep(0.5)
        used = gpu_memory_mib()
    return dict(stop_s=round(time.monotonic() - t0, 1), gpu_mib_after_stop=used, left_running=_live_in_group(pgid))


async def _request(client, url: str, model: str, prompt: str, max_tokens: int, r: dict) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    r["start"] = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200].decode(errors='replace')}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank lines, and keep-alive comments while a prompt is computed
                data = line[5:].strip()
                if data == "[DONE]":
                    r["done"] = True
                    break
                msg = json.loads(data)
                if msg.get("error"):
                    r["error"] = str(msg["error"])[:200]
                if msg.get("usage"):
                    r["usage"] = msg["usage"]
                for choice in msg.get("choices") or []:
                    k = len(WORD.findall(choice.get("text") or ""))
                    if k:
                        now = time.perf_counter()
                        if last is None:
                            r["ttft"] = now - r["start"]
                        else:
                            r["itl"] += [(now - last) / k] * k
                        last = r["last"] = now
                        r["tokens"] += k
                        r["chunks"] += 1
                    r["finish"] = choice.get("finish_reason") or r["finish"]
    except asyncio.CancelledError:
        r["error"] = "unfinished at the phase's time limit"
        raise
    except Exception as e:  # noqa: BLE001 - any broken request is counted as failed, with its reason
        r["error"] = f"{type(e).__name__}: {e}"[:200]
    finally:
        r["end"] = time.perf_counter()


async def _load(url: str, model: str, prompts: list[str], starts: list[float], max_tokens: int,
                timeout: float) -> tuple[list[dict], float, float]:
    """Send prompt i at ``starts[i]`` seconds whatever is still running (open loop); requests still out after
    ``timeout`` are cancelled (failed). Returns the results, the clock's zero and the last finish."""
    import httpx

    results = [dict(prompt_len=len(p), start=None, end=None, ttft=None, last=None, itl=[], tokens=0, chunks=0,
                    usage=None, finish=None, done=False, error=None) for p in prompts]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int):
            await asyncio.sleep(max(0.0, t0 + starts[i] - time.perf_counter()))
            await _request(client, url, model, prompts[i], max_tokens, results[i])

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for r in results:
        if r["start"] is None:
            r["error"] = "not sent before the phase's time limit"
    return results, t0, max((r["end"] for r in results if r["end"] is not None), default=t0)


def load(url, model, prompts, starts, max_tokens, timeout):
    return asyncio.run(_load(url, model, prompts, starts, max_tokens, timeout))


def _pct(xs: list[float], scale: float) -> list[float | None]:
    return [round(float(np.percentile(xs, q)) * scale, 4) if xs else None for q in (50, 90, 99)]


def summarize(results: list[dict], t0: float, t_end: float, max_tokens: int) -> dict:
    ok = [r for r in results if r["error"] is None and r["done"] and r["finish"] is not None and r["usage"]]
    usage = [r["usage"] for r in ok]
    prompt_tokens = sum(u.get("prompt_tokens") or 0 for u in usage)
    output_tokens = sum(u.get("completion_tokens") or 0 for u in usage)
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in usage]
    wall = t_end - t0
    events = sorted([(r["start"], 1) for r in results if r["end"]] + [(r["end"], -1) for r in results if r["end"]])
    in_flight = np.cumsum([e for _, e in events]).max() if events else 0
    errors = sorted({r["error"] for r in results if r["error"]})
    return dict(
        requests=len(results), ok=len(ok), failed=len(results) - len(ok),
        short=sum((r["usage"].get("completion_tokens") or 0) < max_tokens for r in ok),
        count_mismatch=sum(r["tokens"] != r["usage"].get("completion_tokens") for r in ok),
        prompt_mismatch=sum(r["usage"].get("prompt_tokens") != r["prompt_len"] for r in ok),
        cached_tokens=None if all(c is None for c in cached) else sum(c or 0 for c in cached),
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, wall_s=round(wall, 2),
        total_tok_s=round((prompt_tokens + output_tokens) / wall, 1) if wall > 0 else None,
        output_tok_s=round(output_tokens / wall, 1) if wall > 0 else None,
        ttft_s=_pct([r["ttft"] for r in ok], 1), itl_ms=_pct([x for r in ok for x in r["itl"]], 1e3),
        # A request's mean gap (vLLM's TPOT): unlike ITL, blind to tokens that arrive in bursts.
        tpot_ms=_pct([(r["last"] - r["start"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1], 1e3),
        tokens_per_chunk=round(sum(r["tokens"] for r in ok) / max(1, sum(r["chunks"] for r in ok)), 2),
        max_in_flight=int(in_flight), errors=errors[:3])


def serve_alone(name: str, ckpt: Path, fmt: str, plans: list[dict], args, deadline: float, idle_mib, record) -> None:
    """One server's run on ``ckpt``: start it, each rate's warm-up and timed load, stop it; ``record`` gets one
    row a rate, also when the run is stopped part-way (SIGTERM)."""
    left = lambda: deadline - time.monotonic()  # noqa: E731
    base = dict(server=name, weights=fmt)
    rows = [dict(base, rate=p["rate"], prompt_seed=p["seed"], warmup_seed=p["warmup_seed"][name]) for p in plans]
    sent = [t[:32] for p in plans for t in p["prompts"] + p["warmup"][name]]
    assert len(set(sent)) == len(sent), "a prompt repeats within one server's run"
    if left() < 60:
        return record([dict(r, error="skipped: the time budget is spent") for r in rows])
    server = launch(name, ckpt, args, Path(args.out) / "logs")
    t_launch = time.monotonic()
    try:
        server.start(timeout=min(args.start_timeout, left()))
        command = shlex.join(server.proc.args)
        model = server.model_name()
        for row, plan in zip(rows, plans):
            row["command"] = command
            warm = plan["warmup"][name]
            res, t0, t_end = load(server.url, model, warm, [0.0] * len(warm), min(16, args.max_tokens),
                                  max(1.0, min(args.warmup_timeout, left())))
            row["ready_s"] = rows[0].get("ready_s") or round(time.monotonic() - t_launch, 1)
            bad = [r["error"] or "no finish" for r in res if r["error"] or not r["done"]]
            if bad:
                row["error"] = f"warm-up failed: {bad[0]}"
                break
            res, t0, t_end = load(server.url, model, plan["prompts"], plan["starts"], args.max_tokens,
                                  max(1.0, min(plan["starts"][-1] + args.drain_timeout, left() - 20)))
            row.update(summarize(res, t0, t_end, args.max_tokens))
            print(f"{name} {fmt} rate {plan['rate']}: {row['ok']}/{row['requests']} ok, TTFT p50 {row['ttft_s'][0]}s,"
                  f" {row['total_tok_s']} tok/s", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - a server that fails to start or serve is a row that says so
        for row in rows:
            if "ok" not in row:
                row.setdefault("error", f"{type(e).__name__}: {e}"[:300])
    finally:
        stopped = stop_alone(server, idle_mib, min(args.stop_timeout, max(10.0, left())))
        for row in rows:
            row.update(stopped)
            if "ok" not in row:
                row.setdefault("error", "not run: stopped, or an earlier phase failed")
        record(rows)


def _f(xs, digits=3):
    return "/".join("–" if x is None else f"{x:.{digits}g}" for x in xs)


COLUMNS = ("server", "weights", "rate /s", "ok / failed", "checks", "cached tokens", "TTFT p50/p90/p99 s",
           "ITL p50/p90/p99 ms", "TPOT p50/p99 ms", "total tok/s", "output tok/s", "most in flight", "ready s")


def checks(r: dict) -> str:
    """What the completed requests got wrong: fewer tokens than asked, a prompt not of its intended length,
    a streamed count unlike the server's usage."""
    bad = [f"{r[k]} {what}" for k, what in (("short", "short"), ("prompt_mismatch", "prompt length off"),
                                             ("count_mismatch", "count off")) if r[k]]
    return ", ".join(bad) or "all right"


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    for r in rows:
        cells = [r["server"], r["weights"], r["rate"]]
        if "ok" in r:
            cached = "–" if r["cached_tokens"] is None else r["cached_tokens"]
            cells += [f"{r['ok']} / {r['failed']}", checks(r), cached,
                      _f(r["ttft_s"]), _f(r["itl_ms"]), _f(r["tpot_ms"][::2]), _f([r["total_tok_s"]], 5),
                      _f([r["output_tok_s"]], 5), r["max_in_flight"], r.get("ready_s", "–")]
        else:
            cells += [r["error"]] + [""] * (len(COLUMNS) - 4)
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> str:
    out = ["| weights | rate /s | total tok/s mlxd / mlx_lm | TTFT p50 mlxd / mlx_lm | TTFT p99 mlxd / mlx_lm |",
           "|---|---|---|---|---|"]
    by = {(r["server"], r["weights"], r["rate"]): r for r in rows if r.get("ok")}
    for (server, fmt, rate), ours in by.items():
        peer = by.get(("mlx_lm", fmt, rate))
        if server != "mlxd" or peer is None:
            continue
        div = lambda a, b: f"{a / b:.2f}x" if a and b else "–"  # noqa: E731
        out.append(f"| {fmt} | {rate} | {div(ours['total_tok_s'], peer['total_tok_s'])} "
                   f"| {div(ours['ttft_s'][0], peer['ttft_s'][0])} | {div(ours['ttft_s'][2], peer['ttft_s'][2])} |")
    return "\n".join(out) + "\n\nmlxd ahead: tokens/s above 1x, TTFT below 1x."


def parser() -> argparse.ArgumentParser:
    from mlxd.bench.gpu_serving import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES), help="the checkpoint's shape")
    ap.add_argument("--weights", default=",".join(FORMATS), help="comma-separated: bf16, q4")
    ap.add_argument("--rates", default="2,8", help="comma-separated arrival rates, requests a second")
    ap.add_argument("--num-prompts", default="32,64", help="timed requests at each rate (one, or one a rate)")
    ap.add_argument("--prompt-lens", default="256,2048", help="least,most prompt tokens (uniform)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=4, help="untimed requests sent at once before each rate")
    ap.add_argument("--max-model-len", type=int, default=4096, help="mlxd serve's context length")
    ap.add_argument("--mlxd-args", default="", help="more flags for mlxd serve, one string")
    ap.add_argument("--mlx-lm-args", default="", help="more flags for mlx_lm server, one string")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="/tmp/mlxd-http", help="where the checkpoints are written (reused)")
    ap.add_argument("--out", default="bench/results/gpu_http", help="where gpu_http.jsonl/.md and logs go")
    ap.add_argument("--budget-s", type=float, default=520, help="the whole run's time limit")
    ap.add_argument("--checkpoint-timeout", type=float, default=240)
    ap.add_argument("--start-timeout", type=float, default=240)
    ap.add_argument("--warmup-timeout", type=float, default=120)
    ap.add_argument("--drain-timeout", type=float, default=120, help="seconds past the last arrival")
    ap.add_argument("--stop-timeout", type=float, default=60)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through `finally`: servers are stopped
    deadline = time.monotonic() + args.budget_s
    rates = [float(x) for x in args.rates.split(",")]
    nums = [int(x) for x in args.num_prompts.split(",")]
    nums = nums * len(rates) if len(nums) == 1 else nums
    lo, hi = map(int, args.prompt_lens.split(","))
    assert len(nums) == len(rates) and hi + args.max_tokens <= args.max_model_len
    assert set(args.weights.split(",")) <= set(FORMATS), f"--weights: some of {', '.join(FORMATS)}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl, md = out / "gpu_http.jsonl", out / "gpu_http.md"
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"], capture_output=True,
                         text=True).stdout.strip() if shutil.which("nvidia-smi") else "no NVIDIA GPU"
    command = "python -m bench.gpu_http " + shlex.join(sys.argv[1:] if argv is None else argv)
    run = dict(kind="run", command=command, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), gpu=gpu,
               mlx=metadata.version("mlx"), mlx_lm=metadata.version("mlx-lm"), python=sys.version.split()[0],
               seed=args.seed, model=args.model, prompt_lens=[lo, hi], max_tokens=args.max_tokens)
    print(f"seed {args.seed}; {gpu}; mlx {run['mlx']}, mlx-lm {run['mlx_lm']}", file=sys.stderr)
    jsonl.write_text(json.dumps(run) + "\n")
    rows: list[dict] = []

    def record(new: list[dict]) -> None:
        rows.extend(new)
        with jsonl.open("a") as f:
            f.writelines(json.dumps(dict(r, kind="row")) + "\n" for r in new)
        commands = sorted({f"- `{r['command']}`" for r in rows if r.get("command")})
        md.write_text(f"`{command}` ({run['date']}, {gpu}, mlx {run['mlx']}, mlx-lm {run['mlx_lm']}, seed "
                      f"{args.seed}; prompts {lo}-{hi} tokens, {args.max_tokens} generated, greedy, streamed)\n\n"
                      + "\n".join(commands) + f"\n\n{table(rows)}\n\n{ratios(rows)}\n")

    for fmt in args.weights.split(","):
        fi, plans = FORMATS.index(fmt), []
        for ri, (rate, n) in enumerate(zip(rates, nums)):
            seed = draw_seed(args.seed, fi, ri)  # the timed prompts and arrivals: the same for both servers
            warm = {s: draw_seed(args.seed, fi, ri, 1 + si) for si, s in enumerate(SERVERS)}
            plans.append(dict(rate=rate, seed=seed, prompts=prompt_texts(seed, n, lo, hi),
                              starts=arrivals(seed, n, rate), warmup_seed=warm,
                              warmup={s: prompt_texts(warm[s], args.warmup, lo, hi) for s in SERVERS}))
            print(f"{fmt} rate {rate}: timed prompt seed {seed}, warm-up seeds {warm}", file=sys.stderr)
        try:
            ckpt = checkpoint(args, fmt, min(args.checkpoint_timeout, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - the row says why the format was not measured
            record([dict(server=s, weights=fmt, rate=p["rate"], error=f"checkpoint: {e}") for s in SERVERS
                    for p in plans])
            continue
        idle_mib = gpu_memory_mib()
        for name in SERVERS:
            if name != SERVERS[0] and not any("ok" in r for r in rows if r["server"] == SERVERS[0] and r["weights"] == fmt):
                # Without mlxd's rows the peer's measure nothing to compare: its time goes to what is left.
                record([dict(server=name, weights=fmt, rate=p["rate"], error=f"skipped: {SERVERS[0]} did not serve")
                        for p in plans])
                continue
            serve_alone(name, ckpt, fmt, plans, args, deadline, idle_mib, record)
    print(md.read_text())
    return 0 if all(r.get("failed") == 0 and checks(r) == "all right" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
