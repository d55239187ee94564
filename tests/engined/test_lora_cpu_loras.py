"""--max-cpu-loras: host copies of at most that many adapters, counted by the memory guard; the others are
read again from disk when they next take a slot, and a request whose adapter's files changed fails alone."""

import os
import shutil

import numpy as np
import pytest

from mlxd.engined.lora.adapters import read_adapter
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import SamplingParams
from tests.engined.test_lora import _engine, _module_shapes, _load, setups  # noqa: F401 (the fixture)
from tests.tiny_models import fresh_seed


def _run(engine, prompts, loras, params):
    """Outputs by request id, and the errors of those that failed."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, lora in zip(ids, prompts, loras):
        engine.add_request(rid, prompt, params, lora_name=lora)
    outputs, errors = {rid: [] for rid in ids}, {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        errors.update(dict(engine.take_errors()))
    return outputs, errors


def test_one_host_copy_reads_the_other_adapter_again_and_answers_alike(setups, tmp_path):
    model_dir, a_dir, b_dir, _ = setups("llama")
    a_copy = shutil.copytree(a_dir, tmp_path / "a")
    # One slot and one host copy: every switch between A and B writes the slot from a read of the files.
    tight = _engine(model_dir, "float32", a_copy, b_dir, max_loras=1, max_cpu_loras=1)
    roomy = _engine(model_dir, "float32", a_copy, b_dir, max_loras=2)
    rng = np.random.default_rng(fresh_seed("cpu loras"))
    prompts = [rng.integers(0, 256, int(rng.integers(5, 20))).tolist() for _ in range(6)]
    loras = ["A", "B", None, "B", "A", None]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert tight.generate(prompts, params, loras) == roomy.generate(prompts, params, loras)
    sizes = {name: read_adapter(str(d)).nbytes for name, d in (("A", a_copy), ("B", b_dir))}
    assert tight.lora.host_bytes in sizes.values()  # one adapter's copy, never both
    assert roomy.lora.host_bytes == sum(sizes.values())

    # A has neither a slot nor a host copy now (B ran last); its files change: A's request fails with the
    # reason, B's and the base's in the same steps are untouched.
    tight.generate([prompts[1]], params, ["B"])
    want = roomy.generate([prompts[1], prompts[2]], params, ["B", None])
    stat = os.stat(a_copy / "adapters.safetensors")
    os.utime(a_copy / "adapters.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    outputs, errors = _run(tight, [prompts[0], prompts[1], prompts[2]], ["A", "B", None], params)
    assert set(errors) == {"r0"} and "changed on disk since it was loaded" in errors["r0"].message
    assert [outputs["r1"], outputs["r2"]] == want
    # Unloaded and loaded again, it serves its (unchanged) weights.
    tight.unload_lora("A")
    tight.load_lora("A", str(a_copy))
    assert tight.generate([prompts[0]], params, ["A"]) == roomy.generate([prompts[0]], params, ["A"])


def test_the_memory_guard_sets_aside_max_cpu_loras_full_rank_copies(setups):
    model_dir, a_dir, b_dir, _ = setups("llama")
    engine = _engine(model_dir, "float32", a_dir, b_dir, max_loras=2, max_cpu_loras=3)
    # Every projection of every layer at --max-lora-rank 8, float32, per adapter (on the CPU host and device
    # memory are one).
    rank = 8
    shapes = _module_shapes(_load(model_dir, "float32").model)
    one = sum((d_in + d_out) * rank * 4 for d_in, d_out, _ in shapes.values())
    assert engine.lora.fixed_bytes == 3 * one
    assert engine.memory.fixed_bytes == engine.runner.kv.fixed_bytes + 3 * one
    assert engine.lora.host_bytes <= engine.lora.fixed_bytes


def test_max_cpu_loras_below_max_loras_is_refused():
    with pytest.raises(InvalidRequestError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
