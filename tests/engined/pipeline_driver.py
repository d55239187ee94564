"""Rank 0 of a pipeline test: the in-process Engine over ranks started on loopback (`mlxd.ranks`).

Run as ``python -m tests.engined.pipeline_driver CONFIG_JSON PROMPTS_JSON``; prints one JSON line:
each prompt's greedy tokens (a second pass after the other ranks rested), the pool size and the
cached-token counts.
"""

from __future__ import annotations

import json
import sys

import msgspec


def main() -> int:
    from mlxd import ranks
    from mlxd.shared.config import EngineConfig

    config = msgspec.json.decode(sys.argv[1], type=EngineConfig)
    prompts = json.loads(sys.argv[2])
    children = ranks.start_local(config)
    try:
        from mlxd.engined.device import load_fast_blas

        load_fast_blas()
        from mlxd.engined.engine import Engine
        from mlxd.shared.protocol import SamplingParams

        engine = Engine(config)
        params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]) if len(sys.argv) > 3 else 8,
                                ignore_eos=True)
        first = engine.generate(prompts, params)
        # Nothing in flight: the other ranks rest on the doorbell (as the daemon's housekeeping has
        # them do), and the next pass must wake them.
        engine.release_idle_memory()
        rested = engine.runner.link.resting
        again = engine.generate(prompts[:2], params)  # their prefixes are cached now
        print(json.dumps({"tokens": first, "again": again, "num_blocks": engine.memory.num_blocks,
                          "own_blocks": engine.runner.own_blocks,
                          "hits": engine.runner.kv.hits, "steps": engine.num_steps,
                          "overlapped": engine.runner.num_overlapped, "rested": rested,
                          "drafted": engine.metrics.spec_draft_tokens._value.get(),
                          "accepted": engine.metrics.spec_accepted._value.get()}), flush=True)
    finally:
        for child in children:
            child.terminate()
            child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
