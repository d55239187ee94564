"""2,000 seeded hostile requests across every route of a real `mlxd serve` (the generator is bench/fuzz.py's).

No answer is a 5xx, every error is in its route's error shape, the engine is
the same process at the end, and a normal request is answered correctly.
A failing case is replayed with ``python -m bench.fuzz --seed SEED --only INDEX``.
"""

from __future__ import annotations

import asyncio

from mlxd.bench.fuzz import ROUTES, greedy_answer, make_case, send_all
from tests.e2e.serve_harness import SMALL, Serve

SEED = 18
REQUESTS = 2000


def test_two_thousand_hostile_requests_leave_the_server_serving(tmp_path):
    print(f"fuzz seed {SEED}: replay a case with python -m bench.fuzz --seed {SEED} --only INDEX")
    cases = [make_case(SEED, i) for i in range(REQUESTS)]
    assert {c.route for c in cases} == set(ROUTES)
    serve = Serve(tmp_path, *SMALL).start().wait_healthy()
    try:
        pid = serve.engine_pid()
        before = greedy_answer(serve.url)
        assert before is not None
        report = asyncio.run(send_all(serve.url, cases, concurrency=8))
        assert not report.problems, "\n".join(f"case {i} ({m}): {p}" for i, m, p in report.problems[:20])
        assert sum(report.statuses.values()) == REQUESTS
        assert serve.engine_pid() == pid
        assert greedy_answer(serve.url) == before
    finally:
        serve.stop()
    print(f"statuses {dict(report.statuses)}; {REQUESTS / report.wall:.0f} requests/s")
