"""Images through the packed step: a tiny Gemma 3 built from mlx-vlm's classes, mlxd's greedy tokens
against mlx-vlm's own ``generate_step`` on the same weights and pixels.

Steps of 16 tokens cut through every image's 16 tokens (chunked prefill), text-only requests share
the steps, and prefix caching is on: a later turn with the same image reuses its blocks, one with
another image at the same place does not.
"""

import hashlib
from pathlib import Path

import numpy as np
import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import ImageInput, SamplingParams
from tests.tiny_models import make_tiny_model
from tests.vision_models import IMAGE, make_tiny_gemma3_vlm, random_image

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(model dir, processor, mlx-vlm's model)."""
    from mlx_vlm.utils import load_model as vlm_load
    from transformers import Gemma3Processor

    path = make_tiny_gemma3_vlm(tmp_path_factory.mktemp("gemma3_vlm"), seed=3)
    return path, Gemma3Processor.from_pretrained(path), vlm_load(Path(path))


def prompt(processor, texts: list[str], images: list) -> tuple[list[int], list[ImageInput], np.ndarray | None]:
    """A user turn of ``texts`` with an image before each of the first ``len(images)``: token ids,
    the ImageInputs the gateway would send, and the processor's pixels."""
    content = []
    for i, text in enumerate(texts):
        if i < len(images):
            content.append({"type": "image"})
        content.append({"type": "text", "text": text})
    rendered = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                       add_generation_prompt=True, tokenize=False)
    out = processor(text=rendered, images=images or None, add_special_tokens=False, return_tensors="np")
    ids = out["input_ids"][0].tolist()
    if not images:
        return ids, [], None
    pixels = out["pixel_values"].astype(np.float32)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE)
    starts = [i for i, t in enumerate(ids) if t == image_id and ids[i - 1] != image_id]
    length = ids.count(image_id) // len(images)
    inputs = [ImageInput(mm_hash=hashlib.sha256(px.tobytes()).hexdigest(), offset=s, length=length,
                         shape=list(px.shape), pixels=px.tobytes()) for s, px in zip(starts, pixels)]
    return ids, inputs, pixels


def reference(model, ids: list[int], pixels) -> list[int]:
    """mlx-vlm's own greedy tokens."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    mask = mx.ones((1, len(ids)), dtype=mx.int32)
    steps = generate_step(mx.array([ids]), model, None if pixels is None else mx.array(pixels), mask,
                          max_tokens=GREEDY.max_tokens, temperature=0.0)
    return [int(t) for t, _ in steps]


def engine(path, **kw) -> Engine:
    return Engine(EngineConfig(num_kv_blocks=96, block_size=16, max_num_batched_tokens=16, max_num_seqs=8,
                               enable_prefix_caching=True, **kw), loaded=load_model(str(path)))


def run(eng: Engine, requests: list[tuple[list[int], list[ImageInput]]]) -> tuple[list[list[int]], list[int]]:
    """Run together; (tokens, cached prompt tokens) of each, in order."""
    ids = [f"r{run.counter + i}" for i in range(len(requests))]
    run.counter += len(requests)
    for rid, (tokens, images) in zip(ids, requests):
        eng.add_request(rid, tokens, GREEDY, images=images)
    out, cached = {r: [] for r in ids}, {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens
    return [out[r] for r in ids], [cached[r] for r in ids]


run.counter = 0


# A GPU's defaults too: the next step built while the last one's tokens are on the device, decode replayed.
@pytest.mark.parametrize("steps", [{}, {"async_scheduling": True, "compile_decode": True}], ids=["sync", "async"])
def test_greedy_tokens_equal_mlx_vlm_with_one_and_two_images_batched_with_text(vlm, steps):
    path, processor, model = vlm
    cat, dog = random_image(1), random_image(2, (80, 30))
    cases = [prompt(processor, ["the cat"], [cat]), prompt(processor, ["the cat"], [dog]),
             prompt(processor, ["a", "and then"], [cat, dog]), prompt(processor, ["only text here"], [])]
    expected = [reference(model, ids, pixels) for ids, _, pixels in cases]
    assert expected[0] != expected[1], "the image must decide the answer, or this test proves nothing"
    got, _ = run(engine(path, **steps), [(ids, images) for ids, images, _ in cases])
    assert got == expected


def test_second_turn_reuses_the_image_blocks_and_another_image_does_not(vlm):
    path, processor, model = vlm
    cat, dog = random_image(1), random_image(2, (80, 30))
    eng = engine(path)
    first = prompt(processor, ["the cat", "sat"], [cat])
    run(eng, [first[:2]])
    again = prompt(processor, ["the cat", "sat on the mat"], [cat])
    other = prompt(processor, ["the cat", "sat on the mat"], [dog])
    assert again[0] == other[0]  # the same tokens: only the image tells them apart
    image_end = again[1][0].offset + again[1][0].length
    got, cached = run(eng, [again[:2]])
    assert cached[0] >= image_end // 16 * 16 and cached[0] > 0
    assert got[0] == reference(model, again[0], again[2])
    got, cached = run(eng, [other[:2]])
    assert cached[0] <= again[1][0].offset
    assert got[0] == reference(model, other[0], other[2])


def test_an_image_for_a_text_only_model_is_refused_naming_it(tmp_path, vlm):
    text_only = Engine(EngineConfig(num_kv_blocks=16, block_size=16, max_num_batched_tokens=64),
                       loaded=load_model(str(make_tiny_model(tmp_path / "llama", "llama"))))
    _, images, _ = prompt(vlm[1], ["x"], [random_image(1)])
    with pytest.raises(InvalidRequestError, match="llama.*does not take images"):
        text_only.add_request("t", list(range(40)), GREEDY, images=images)


def test_an_image_whose_placeholder_run_is_not_the_towers_is_refused_and_the_engine_goes_on(vlm):
    path, processor, model = vlm
    ids, images, pixels = prompt(processor, ["the cat"], [random_image(1)])
    short = ImageInput(images[0].mm_hash, images[0].offset, images[0].length - 1, images[0].shape, images[0].pixels)
    eng = engine(path)
    with pytest.raises(InvalidRequestError, match="fills 16 placeholder tokens, not 15"):
        eng.add_request("bad", ids, GREEDY, images=[short])
    assert run(eng, [(ids, images)])[0][0] == reference(model, ids, pixels)
