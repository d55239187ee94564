"""The project files one plain streamed chat request enters, traced in a real engine and gateway
(``bench/trace/request_path.py``): at most CAP of them, and DESIGN.md names exactly those.

CAP is 15, one file per concept the request needs. The gateway: its app and guards, the state it holds
for the engine (the engine's client among it), the chat route and run, the one place fields are checked
and prompts made, and the generation that turns tokens into the stream. The wire's protocol, on both
sides. The engine: its daemon, the engine and its step, the request, the scheduler, the KV cache manager
with its main group and block pool, the runner with what it installs into the model, the paged-KV layout
with the host's attention, the sampler and the metrics.
"""

from __future__ import annotations

import re

import pytest

from mlxd.bench.trace.request_path import PROCESSES, ROOT, distinct, trace

CAP = 15


@pytest.fixture(scope="module")
def traced() -> dict[str, list[str]]:
    files, reply = trace()
    assert reply, "the traced request produced no text"
    for name in PROCESSES:
        print(f"{name}: {files[name]}")
    return files


@pytest.mark.timeout(900)
def test_a_plain_streamed_chat_request_enters_at_most_cap_project_files(traced):
    files = distinct(traced)
    assert len(files) <= CAP, f"{len(files)} files: {files}"


@pytest.mark.timeout(900)
def test_design_md_names_the_files_the_traced_request_enters(traced):
    design = (ROOT / "DESIGN.md").read_text()
    for name in PROCESSES:
        line = re.search(rf"^- \*\*{name}\*\* \((\d+) files\): (.+)$", design, re.M)
        assert line, f"DESIGN.md has no line '- **{name}** (N files): ...'"
        named = re.findall(r"`([^`]+)`", line.group(2))
        assert int(line.group(1)) == len(named)
        assert sorted(named) == sorted(traced[name]), f"{name}: DESIGN.md {named}, traced {traced[name]}"
    count = re.search(r"^(\d+) distinct project files\.$", design, re.M)
    assert count and int(count.group(1)) == len(distinct(traced))
