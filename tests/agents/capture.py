"""Capture the CLIs' requests again as fixtures: `python -m tests.agents.capture` (after .ci/run's npm install).

Runs the same round trips as test_coding_clis.py and writes each CLI's first
request and its tool follow-up into tests/agents/fixtures/ (Claude Code's
first request with its default tools comes from a run without `--tools`).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.agents import clis

FIXTURES = Path(__file__).parent / "fixtures"


def _save(name: str, body: dict) -> None:
    (FIXTURES / name).write_text(json.dumps(body, indent=1, ensure_ascii=False) + "\n")


def _pair(run: clis.Run, path: str, first: str, follow: str) -> None:
    posts = [e for e in run.posts if e.path.startswith(path)]
    if run.returncode != 0 or len(posts) < 2:
        sys.exit(f"no round trip: rc={run.returncode}, {len(posts)} requests\n{run.stderr[-2000:]}")
    _save(first, posts[0].body)
    _save(follow, posts[1].body)


def main() -> None:
    if clis.installed() is not None:
        sys.exit(f"install the CLIs first: {clis.installed()}")
    with tempfile.TemporaryDirectory(prefix="mlxd-capture-") as d, clis.serve(Path(d)) as (url, model):
        tmp = Path(d)
        _pair(clis.codex_round_trip(url, model, tmp), "/v1/responses", "codex_first.json",
              "codex_tool_followup.json")
        _pair(clis.claude_round_trip(url, model, tmp), "/v1/messages", "claude_code_first.json",
              "claude_code_tool_followup.json")
        work = tmp / "claude-default"
        work.mkdir()
        full = clis.claude_print(url, model, tmp / "claude-home-default", work, "Say hi.", tools="default")
        _save("claude_code_default_first.json", next(e.body for e in full.posts if e.path.startswith("/v1/messages")))


if __name__ == "__main__":
    main()
