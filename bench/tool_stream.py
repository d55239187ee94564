"""What streaming one long tool call costs per delta: the incremental parsers against whole-text rescans.

A 20 KB ``write(text=...)`` call in each format is streamed in token-sized
deltas (4 characters) through ``ToolStream``. The peer, ``RescanHermesPeer``,
is the algorithm the gateway used before (kept here only as the peer): every
delta re-reads the whole text so far and streams the difference from the
previous reading, O(n^2) per request. Both run in the same process, alternating,
median of ``--repeats``.

    python -m bench.tool_stream [--size 20000] [--delta 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time

from mlxd.gateway.parsers import TOOL_PARSERS, ToolStream
from tests.gateway.test_parsers_incremental import WRITE, long_call, payload

_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _value_end(text: str, i: int) -> int | None:
    depth, in_str, esc = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_str:
            esc, in_str = (False, in_str) if esc else (c == "\\", c != '"')
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


class RescanHermesPeer:
    """The former hermes streaming: scan the whole text on each delta, send what grew since the last scan."""

    def __init__(self):
        self.text, self.sent_content, self.sent_args, self.named = "", 0, "", False
        self.scanned = 0

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        text = self.text
        self.scanned += len(text)
        i = text.find("<tool_call>")
        content = text if i < 0 else text[:i]
        args = ""
        if i >= 0:
            end = text.find("</tool_call>", i)
            body = text[i + len("<tool_call>"): end if end >= 0 else len(text)]
            m = _NAME_FIRST.match(body)
            if m:
                self.named = True
                stop = _value_end(body, m.end())
                args = body[m.end(): stop or len(body)].strip()
        out_content = content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(content))
        out_args = args[len(self.sent_args):] if args.startswith(self.sent_args) else ""
        self.sent_args = max(self.sent_args, args, key=len)
        return out_content, out_args


def run_peer(deltas: list[str]) -> tuple[float, int, str]:
    peer = RescanHermesPeer()
    t0 = time.perf_counter()
    args = "".join(peer.feed(d)[1] for d in deltas)
    return time.perf_counter() - t0, peer.scanned, args


def run_new(name: str, deltas: list[str]) -> tuple[float, int, str]:
    stream = ToolStream(TOOL_PARSERS[name]([WRITE]))
    t0 = time.perf_counter()
    args = []
    for d in deltas:
        for call in stream.feed(d)[1]:
            args.append(call["function"]["arguments"])
    for call in stream.finish()[1]:
        args.append(call["function"]["arguments"])
    return time.perf_counter() - t0, stream.parser.meter.scanned, "".join(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=20_000, help="characters of the call's text argument")
    ap.add_argument("--delta", type=int, default=4, help="characters per streamed delta")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print(f"seed {args.seed}")
    text = payload(random.Random(args.seed), args.size)
    rows = []
    for name in sorted({cls.name for cls in TOOL_PARSERS.values()}):
        call = long_call(name, text)
        deltas = [call[i:i + args.delta] for i in range(0, len(call), args.delta)]
        new_t, peer_t = [], []
        for _ in range(args.repeats):
            t, scanned, got = run_new(name, deltas)
            assert json.loads(got) == {"text": text}
            new_t.append(t)
            if name == "hermes":
                t, peer_scanned, got = run_peer(deltas)
                assert json.loads(got) == {"text": text}
                peer_t.append(t)
        row = {"format": name, "chars": len(call), "deltas": len(deltas),
               "new_us_per_delta": statistics.median(new_t) / len(deltas) * 1e6,
               "new_examined_per_char": scanned / len(call)}
        if peer_t:
            row.update(peer_us_per_delta=statistics.median(peer_t) / len(deltas) * 1e6,
                       peer_examined_per_char=peer_scanned / len(call))
        rows.append(row)
        print(json.dumps(row))
    print("| format | characters | deltas | µs per delta | characters examined per character |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "peer_us_per_delta" in r:
            print(f"| {r['format']} (whole-text rescan, before) | {r['chars']} | {r['deltas']} | "
                  f"{r['peer_us_per_delta']:.1f} | {r['peer_examined_per_char']:.0f} |")
        print(f"| {r['format']} | {r['chars']} | {r['deltas']} | {r['new_us_per_delta']:.1f} | "
              f"{r['new_examined_per_char']:.1f} |")


if __name__ == "__main__":
    main()
