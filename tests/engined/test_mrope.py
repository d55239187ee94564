"""Qwen-VL's multi-axis RoPE positions (engined/vision/mrope.py) against mlx-vlm's own rope index,
for Qwen2.5-VL and Qwen3.5, on the gateway's expansion (checked against mlx-vlm's processor) of a
prompt with two images of different grids (one wider than tall, one taller than wide): the whole
prompt, the same prompt computed in chunks that cut through the images, and the positions after it
(decode), which mlx-vlm gives as the sequence index plus its rope delta. Qwen3.5's interleaved
rotation against mlx-vlm's own rotary embedding, on a partial RoPE of Qwen3.5's shape. And what is
refused: an image whose grid the merger cannot fold (at admission, the engine going on) and rotary
sections that miss the RoPE's dimensions (at load)."""

import hashlib
import json

import numpy as np
import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.engined.vision.mrope import LAYOUTS, MRope, StepPositions, request_positions
from mlxd.gateway.media import Image
from mlxd.gateway.media_processor import expand_with, image_token_id
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError, ModelLoadError
from mlxd.shared.protocol import ImageInput, SamplingParams
from tests.vision_models import QWEN_MERGE, make_tiny_qwen2_5_vl, make_tiny_qwen3_5_vl, processor_of, random_image


def _mlx_vlm_processor(family: str):
    # mlx-vlm's processors of these families, which (unlike transformers') run without torchvision.
    if family == "qwen3_5":
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
        return Qwen3VLProcessor
    from mlx_vlm.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    return Qwen2_5_VLProcessor


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_5"])
def qwen(request, tmp_path_factory):
    from mlx_vlm.utils import load_model as vlm_load

    maker = {"qwen2_5_vl": make_tiny_qwen2_5_vl, "qwen3_5": make_tiny_qwen3_5_vl}[request.param]
    path = maker(tmp_path_factory.mktemp(request.param), seed=5)
    return processor_of(path), vlm_load(path), path, _mlx_vlm_processor(request.param)


def test_positions_equal_mlx_vlm_rope_index_whole_in_chunks_and_after(qwen):
    import mlx.core as mx

    processor, model, _, reference_class = qwen
    seed = 11
    print(f"seed={seed}")
    images = [random_image(seed, (48, 32)), random_image(seed + 1, (30, 44))]
    content = [{"type": "image"}, {"type": "text", "text": "left"}, {"type": "image"}, {"type": "text", "text": "x"}]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                   add_generation_prompt=True, tokenize=False)
    decoded = [Image(im, hashlib.sha256(im.tobytes()).hexdigest()) for im in images]
    ids, inputs = expand_with(processor, image_token_id(processor), text, decoded)
    grids = [[1, i.shape[0], i.shape[1]] for i in inputs]
    assert grids[0][1] < grids[0][2] and grids[1][1] > grids[1][2]  # both orientations

    # The gateway's expansion (transformers' processor needs torchvision) equals mlx-vlm's processor's.
    reference = reference_class(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                                video_processor=None)(text=text, images=images, return_tensors="np")
    assert ids == reference["input_ids"][0].tolist()
    assert grids == reference["image_grid_thw"].tolist()
    pixels = np.concatenate([np.frombuffer(i.pixels, np.float32).reshape(-1, i.shape[2]) for i in inputs])
    assert np.array_equal(pixels, reference["pixel_values"])

    expected, delta = model.language_model.get_rope_index(mx.array([ids]), mx.array(grids), None, None)
    expected, delta = np.array(expected)[:, 0], int(np.array(delta).reshape(-1)[0])
    assert delta != 0  # the images moved the later text's positions, or this proves nothing
    assert (request_positions(inputs, QWEN_MERGE, 0, len(ids)) == expected).all()

    rng = np.random.default_rng(seed)
    cuts = sorted(set(rng.integers(1, len(ids), 5).tolist()) | {inputs[0].offset + 1, inputs[1].offset + 3})
    bounds = [0, *cuts, len(ids)]
    chunks = [request_positions(inputs, QWEN_MERGE, a, b - a) for a, b in zip(bounds, bounds[1:])]
    assert (np.concatenate(chunks, axis=1) == expected).all()

    after = request_positions(inputs, QWEN_MERGE, len(ids), 4)
    assert (after == np.arange(len(ids), len(ids) + 4) + delta).all()


def test_an_image_whose_grid_the_merger_cannot_fold_is_refused_and_the_engine_goes_on(qwen):
    processor, _, path, _ = qwen
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
        add_generation_prompt=True, tokenize=False)
    image = random_image(3, (48, 32))
    ids, (good,) = expand_with(processor, image_token_id(processor), text, [Image(image, "a")])
    h, w, values = good.shape  # 4 x 6 patches: 2 x 3 rows
    odd = ImageInput(good.mm_hash, good.offset, good.length, [h - 1, w * h // (h - 1), values], good.pixels)
    eng = Engine(EngineConfig(num_kv_blocks=16, block_size=16, max_num_batched_tokens=64),
                 loaded=load_model(str(path)))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match=f"fills 0 placeholder tokens, not {good.length}"):
        eng.add_request("odd", ids, params, images=[odd])
    eng.add_request("good", ids, params, images=[good])
    out = []
    while eng.has_unfinished():
        out += [t for o in eng.step() for t in o.new_token_ids]
    assert len(out) == 2


def test_sections_that_do_not_cover_the_rotary_dimensions_are_refused_at_load(tmp_path):
    path = make_tiny_qwen2_5_vl(tmp_path / "odd_sections", seed=5)
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"]["mrope_section"] = [2, 3, 2]  # 7 of the head's 8 frequencies
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"M-RoPE sections \[2, 3, 2\] need the text model's RoPE over 14"):
        Engine(EngineConfig(num_kv_blocks=16, block_size=16, max_num_batched_tokens=64), loaded=load_model(str(path)))


def test_interleaved_rotation_equals_mlx_vlm_qwen3_5_rotary_embedding():
    # Qwen3.5's shape: 256-wide heads, a quarter rotated, sections [11, 11, 10] interleaved.
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_vlm.models.qwen3_5.language import Qwen3_5RotaryEmbedding, apply_multimodal_rotary_pos_emb

    seed = 7
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    sections, dims, base, heads, head_dim, t = [11, 11, 10], 64, 10000000.0, 2, 256, 24
    positions = rng.integers(0, 40, (3, t))
    x = mx.array(rng.standard_normal((t, heads, 1, head_dim)).astype(np.float32))
    cos, sin = Qwen3_5RotaryEmbedding(dims, base=base, mrope_section=sections)(x, mx.array(positions[:, None, :]))
    q = x[:, :, 0, :].transpose(1, 0, 2)[None]  # mlx-vlm's [batch, heads, T, head dim]
    expected = apply_multimodal_rotary_pos_emb(q, q, cos, sin)[0][0].transpose(1, 0, 2)

    def rotated(layout: str) -> mx.array:
        step = StepPositions(LAYOUTS[layout](sections, dims // 2), dims, base, QWEN_MERGE)
        step.set_positions(positions)
        return MRope(nn.RoPE(dims, base=base), step)(x, offset=None)[:, :, 0, :]

    assert mx.allclose(rotated("interleaved"), expected, atol=1e-5).item()
    assert not mx.allclose(rotated("sectioned"), expected, atol=1e-2).item()  # the layout is what is checked
