"""The waiting queue counts every prompt, and admits a client request's prompts all or none."""

import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import OverloadedError
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import fresh_seed, make_tiny_model

PARAMS = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tiny = make_tiny_model(tmp_path_factory.mktemp("queue"), "llama", seed=fresh_seed("model"))
    return Engine(EngineConfig(num_kv_blocks=64, block_size=8, max_waiting_requests=4), loaded=load_model(str(tiny)))


def add_group(engine, name, size):
    """Send a group's members in order, as the gateway does; returns which were refused."""
    refused = []
    for i in range(size):
        try:
            engine.add_request(f"{name}-{i}", [1, 2, 3], PARAMS, group=name, group_size=size)
        except OverloadedError:
            refused.append(i)
    return refused


def finish(engine):
    while engine.has_unfinished():
        engine.step()


def test_a_group_larger_than_the_queue_is_refused_whole_and_holds_no_place(engine):
    engine.add_request("single", [1, 2, 3], PARAMS)
    assert add_group(engine, "big", 8) == list(range(8))
    assert [r.request_id for r in engine.scheduler.waiting] == ["single"]
    # The places it did not take are there for others.
    for i in range(3):
        engine.add_request(f"other-{i}", [1, 2, 3], PARAMS)
    finish(engine)


def test_a_fitting_group_reserves_its_places_against_requests_arriving_between_its_members(engine):
    engine.add_request("single", [1, 2, 3], PARAMS)
    engine.add_request("g-0", [1, 2, 3], PARAMS, group="g", group_size=3)
    with pytest.raises(OverloadedError):  # 1 waiting + 3 for g: full, though only 2 are in the queue yet
        engine.add_request("between", [1, 2, 3], PARAMS)
    engine.add_request("g-1", [1, 2, 3], PARAMS, group="g", group_size=3)
    engine.add_request("g-2", [1, 2, 3], PARAMS, group="g", group_size=3)
    assert len(engine.scheduler.waiting) == 4 and engine.places._reserved == 0 and not engine.places._groups
    finish(engine)
    assert add_group(engine, "again", 4) == []  # nothing left reserved once all arrived
    finish(engine)
