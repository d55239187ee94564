"""The project files one plain streamed chat request enters, traced in a real engine and gateway
(``bench/trace/request_path.py``): at most CAP of them, and DESIGN.md names exactly those.

CAP is 18, three above the goal of 15. Each file left on the path is one concept a request needs,
and the folds that would remove three more join what the reference engines keep apart or make a
module of two concepts past 400 lines: ``engined/request.py`` (one request's state, which the
scheduler, the KV manager, the sampler and the engine all read; vLLM's ``v1/request.py``,
nano-vllm's ``sequence.py``), ``engined/kv/manager.py`` (the KV groups seen as one, which the
scheduler's policy allocates through; into ``scheduler.py`` it made one module of ~640 lines),
``engined/metrics.py`` (every series defined in one place) and ``gateway/engine_client.py`` (the
gateway's end of the socket, beside the state that holds it). Lower CAP when a file leaves the path.
"""

from __future__ import annotations

import re

import pytest

from mlxd.bench.trace.request_path import PROCESSES, ROOT, distinct, trace

CAP = 18


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
