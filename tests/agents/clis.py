"""The real coding CLIs, installed from npm by .ci/run, driven non-interactively against mlxd.

Each CLI runs in a scratch home with its own settings: pointed at one loopback
URL only, telemetry, update checks and error reporting off, no standard input,
and a wall-clock limit, so it can neither reach out nor hang. A ``Recorder``
between the CLI and the gateway keeps every exchange; its ``rewrite`` makes
the first request name one of the CLI's own tools (``tool_choice``, greedy),
so that even a 135M model calls a tool and the CLI sends its follow-up with
the call and the tool's result, and gives Claude Code's follow-ups a stop
sequence so that the model ends its turn. The recorded bodies are the CLI's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.agents.recorder import Exchange, Recorder
from tests.e2e.servers import free_port

REPO = Path(__file__).resolve().parents[2]
NODE_MODULES = REPO / ".ci" / "node_modules"
# Pinned in .ci/run, which installs them.
CODEX_VERSION = "0.171.0"
CLAUDE_CODE_VERSION = "2.1.332"
CODEX = NODE_MODULES / ".bin" / "codex"
# The package's postinstall would put its native binary in place of the stub; npm skips install
# scripts unless allowed, so run it through the package's own wrapper, which finds the binary.
CLAUDE = NODE_MODULES / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"
TIMEOUT = 600


def installed() -> str | None:
    """None when both CLIs are installed, else what to run to install them."""
    if CODEX.exists() and CLAUDE.exists():
        return None
    return (f"npm install --prefix .ci --no-save @openai/codex@{CODEX_VERSION} "
            f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION} (as .ci/run does)")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    exchanges: list[Exchange]

    @property
    def posts(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST"]


def _base_env(home: Path) -> dict:
    # Nothing of the developer's own environment (keys, base URLs, proxies) reaches the CLI.
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "TERM": "dumb", "NO_COLOR": "1"}


def _holds(turns: list, kinds: tuple[str, ...]) -> bool:
    """Whether a conversation's items (or their content blocks) include one of ``kinds``."""
    for t in turns:
        if not isinstance(t, dict):
            continue
        blocks = t.get("content") if isinstance(t.get("content"), list) else []
        if t.get("type") in kinds or any(isinstance(b, dict) and b.get("type") in kinds for b in blocks):
            return True
    return False


def _forcing(tool: str, results: tuple[str, ...], after: dict | None = None):
    """A Recorder rewrite: name ``tool`` in tool_choice until the conversation holds a tool result,
    then add ``after``'s fields (a stop sequence, so that the small model ends its turn)."""
    def rewrite(path: str, body: dict) -> dict:
        names = [t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)]
        turns = body.get("input") if isinstance(body.get("input"), list) else body.get("messages") or []
        if not _holds(turns, results):
            if tool in names:
                # Greedy: the same call each run (sampled, a 135M model may ramble past the cap).
                body = dict(body, tool_choice=tool_choice_of(path, tool), temperature=0.0)
        elif after:
            body = {**body, **after}
        return body
    return rewrite


def tool_choice_of(path: str, tool: str) -> dict:
    if path.startswith("/v1/messages"):
        return {"type": "tool", "name": tool}
    return {"type": "function", "name": tool}


def _run(cmd: list[str], env: dict, cwd: Path, rec: Recorder) -> Run:
    # Its own process group: a wrapper's child (Claude Code's native binary) goes down with it.
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        err += f"\n[killed after {TIMEOUT} s]"
    return Run(p.returncode, out, err, list(rec.exchanges))


def codex_exec(gateway_url: str, model: str, home: Path, workdir: Path, prompt: str,
               force_tool: str | None = None, context_window: int | None = None) -> Run:
    """``codex exec`` with mlxd as a Responses provider (the README's configuration)."""
    codex_home = home / "codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    config = [f'model = "{model}"', 'model_provider = "mlxd"', "check_for_update_on_startup = false"]
    if context_window:
        config.append(f"model_context_window = {context_window}")
    config += ["", "[model_providers.mlxd]", 'name = "mlxd"', 'base_url = "BASE"', 'wire_api = "responses"',
               "", "[analytics]", "enabled = false", ""]
    # Codex fails a turn that ends incomplete (the operator's cap); greedy, the answer after the
    # tool's result ends by itself.
    rewrite = _forcing(force_tool, ("function_call_output",), {"temperature": 0.0}) if force_tool else None
    with Recorder(gateway_url, rewrite) as rec:
        (codex_home / "config.toml").write_text("\n".join(config).replace("BASE", rec.url + "/v1"))
        env = {**_base_env(home), "CODEX_HOME": str(codex_home)}
        return _run([str(CODEX), "exec", "--skip-git-repo-check", prompt], env, workdir, rec)


def claude_print(gateway_url: str, model: str, home: Path, workdir: Path, prompt: str, tools: str,
                 force_tool: str | None = None) -> Run:
    """``claude -p`` with mlxd as its Anthropic endpoint (the README's environment)."""
    # Claude Code answers a max_tokens stop with "resume" turns and gives up (exit 1) after a few; a
    # 135M model rarely ends a turn by itself, so after the tool's result a sentence ends it.
    rewrite = _forcing(force_tool, ("tool_result",), {"stop_sequences": ["."]}) if force_tool else None
    with Recorder(gateway_url, rewrite) as rec:
        env = {**_base_env(home), "ANTHROPIC_BASE_URL": rec.url, "ANTHROPIC_API_KEY": "unused",
               "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
               "ANTHROPIC_SMALL_FAST_MODEL": model,
               # Claude Code's own switches: no telemetry, error reports, update checks or other
               # traffic beyond the model's endpoint.
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
               "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1"}
        cmd = ["node", str(CLAUDE), "-p", "--tools", tools, "--no-session-persistence", prompt]
        return _run(cmd, env, workdir, rec)


# A context that holds Codex's first prompt (~4,600 tokens under SmolLM2's template), and the
# operator's cap that agents need: they send no output limit, or one far past the context.
CONTEXT = 6144
CAP = 96


@contextlib.contextmanager
def serve(tmp: Path):
    """(url, model) of a fresh `mlxd serve` on loopback (small KV pool), its process group killed after."""
    port = free_port()
    log = open(tmp / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "serve", "--port", str(port),
         "--engine-endpoint", f"ipc://{tmp}/engine.sock", "--kv-cache-memory", "320000000",
         "--max-model-len", str(CONTEXT), "--max-num-batched-tokens", "512", "--shutdown-timeout", "1",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--override-generation-config", json.dumps({"max_new_tokens": CAP})],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError((tmp / "serve.log").read_text()[-4000:])
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("mlxd serve did not become healthy")
            time.sleep(0.5)
        yield url, httpx.get(url + "/v1/models").json()["data"][0]["id"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def codex_round_trip(url: str, model: str, tmp: Path) -> Run:
    """The run the tests check and the fixtures come from: Codex asked about its goal, made to call get_goal."""
    work = tmp / "codex-work"
    work.mkdir(exist_ok=True)
    return codex_exec(url, model, tmp / "codex-home", work, "What is the current goal?", force_tool="get_goal",
                      context_window=CONTEXT)


def claude_round_trip(url: str, model: str, tmp: Path) -> Run:
    """Claude Code asked to read a file, made to call Read."""
    work = tmp / "claude-work"
    work.mkdir(exist_ok=True)
    (work / "NOTES.md").write_text("The answer is 42.\n")
    return claude_print(url, model, tmp / "claude-home", work, "Read NOTES.md and tell me the answer.",
                        tools="Read", force_tool="Read")
