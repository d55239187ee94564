"""Images through the whole stack: `mlxd serve` on a tiny Gemma 3 vision checkpoint (mlx-vlm's classes),
driven by the real openai and anthropic SDKs, with image URLs served from a loopback HTTP server; the
first test also on a tiny Idefics3 (SmolVLM: tiles), a tiny Mistral 3 (Pixtral: placeholders the
gateway writes, images of their own aspect), a tiny Qwen2.5-VL (placeholders the gateway writes,
M-RoPE positions) and a tiny Gemma 4 (its image processor as transformers 5 saves it, per-layer inputs).

The answer to an image equals mlx-vlm's own greedy tokens on the same pixels (the gateway's
processor, the wire and the engine's tower together); bad images and URLs are 400s that leave the
server answering.
"""

import base64
import http.server
import io
import json
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.e2e.serve_harness import Serve
from tests.e2e.servers import assert_error
from tests.vision_models import (VLMS, make_tiny_gemma3_vlm, make_tiny_qwen2_5_vl, processor_of, random_image,
                                 reference_processor)

MAX_TOKENS = 8
LIMIT_BYTES = 50_000


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


CAT, DOG = png(random_image(1)), png(random_image(2, (80, 30)))


class Media(http.server.BaseHTTPRequestHandler):
    """Loopback images: /cat.png, /dog.png, one that takes too long, one too large, a redirect loop."""

    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(3)
        if self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.end_headers()
            return
        body = {"/cat.png": CAT, "/dog.png": DOG, "/slow.png": CAT, "/big.png": b"\x89PNG" + bytes(2 * LIMIT_BYTES)
                }.get(self.path)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except BrokenPipeError:  # the gateway stops reading past its size limit
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Media)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_gemma3_vlm(tmp_path_factory.mktemp("model") / "gemma3_vlm", seed=3)
    serve = Serve(tmp_path_factory.mktemp("serve"), "--num-kv-blocks", "64", "--max-num-batched-tokens", "32",
                  "--enable-prefix-caching", "--limit-mm-per-prompt", '{"image": 2}', "--media-fetch-timeout", "1",
                  "--media-max-bytes", str(LIMIT_BYTES), "--media-max-redirects", "2",
                  "--allowed-media-domains", "127.0.0.1", model=str(path)).start()
    serve.wait_healthy()
    yield path, serve
    serve.stop()


@pytest.fixture(scope="module")
def vlm_client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module", params=["gemma3", "idefics3", "mistral3", "qwen2_5_vl", "gemma4"])
def family(request, tmp_path_factory):
    """(model name, its dir, an openai client) of each vision family: Gemma 3's server above, a
    plain one for the others."""
    if request.param == "gemma3":
        served = request.getfixturevalue("served")
        yield "gemma3_vlm", served[0], request.getfixturevalue("vlm_client")
        return
    path = VLMS[request.param][0](tmp_path_factory.mktemp("model") / f"{request.param}_vlm", seed=3)
    serve = Serve(tmp_path_factory.mktemp("serve"), "--num-kv-blocks", "64", "--max-num-batched-tokens", "32",
                  "--enable-prefix-caching", "--allowed-media-domains", "127.0.0.1", model=str(path)).start()
    serve.wait_healthy()
    yield f"{request.param}_vlm", path, openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0,
                                              timeout=60)
    serve.stop()


@pytest.fixture(scope="module")
def qwen_photos(tmp_path_factory):
    """(dir, server) of a tiny Qwen2.5-VL whose processor keeps up to 12.8M pixels, as Qwen's checkpoints
    state: the engine bounds its images to 1280 image tokens' worth."""
    path = make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("model") / "qwen_photos", seed=3)
    settings = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**settings, "max_pixels": 12845056}))
    serve = Serve(tmp_path_factory.mktemp("serve"), "--num-kv-blocks", "96", "--max-num-batched-tokens", "512",
                  model=str(path)).start()
    serve.wait_healthy()
    yield path, serve
    serve.stop()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def ask(client, url: str, text: str = "the cat", model: str = "gemma3_vlm"):
    return client.chat.completions.create(
        model=model, max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": text}]}])


def expected_text(path: Path, data: bytes, text: str = "the cat") -> str:
    """mlx-vlm's greedy answer to the image and text, decoded as the server decodes."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_model
    from PIL import Image

    processor = reference_processor(processor_of(path))
    rendered = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
        add_generation_prompt=True, tokenize=False)
    out = processor(text=rendered, images=[Image.open(io.BytesIO(data)).convert("RGB")], add_special_tokens=False,
                    return_tensors="np")
    out = {k: np.asarray(v) for k, v in out.items()}
    ids = out["input_ids"][0].tolist()
    extra = {k: mx.array(v) for k, v in out.items() if k.startswith(("pixel_", "image_")) and k != "pixel_values"}
    steps = generate_step(mx.array([ids]), load_model(Path(path)), mx.array(out["pixel_values"].astype(np.float32)),
                          mx.ones((1, len(ids)), dtype=mx.int32), max_tokens=MAX_TOKENS, temperature=0.0, **extra)
    return processor.tokenizer.decode([int(t) for t, _ in steps], skip_special_tokens=True)


def test_openai_data_url_and_loopback_url_answer_as_mlx_vlm_and_reuse_the_image(family, media):
    model, path, client = family
    by_data = ask(client, data_url(CAT), model=model)
    assert by_data.choices[0].message.content == expected_text(path, CAT)
    by_url = ask(client, media + "/cat.png", model=model)
    assert by_url.choices[0].message.content == by_data.choices[0].message.content
    # The same image again: its blocks come from the prefix cache.
    assert by_url.usage.prompt_tokens_details.cached_tokens > 0
    other = ask(client, media + "/dog.png", model=model)
    assert other.choices[0].message.content == expected_text(path, DOG)
    assert other.choices[0].message.content != by_data.choices[0].message.content


def test_anthropic_base64_and_url_images_get_the_same_answer(served, vlm_client, media):
    a = anthropic.Anthropic(base_url=served[1].url, api_key="unused", max_retries=0, timeout=60)
    msg = a.messages.create(model="gemma3_vlm", max_tokens=MAX_TOKENS, extra_body={"temperature": 0.0}, messages=[{
        "role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(CAT).decode()}},
            {"type": "text", "text": "the cat"}]}])
    assert msg.content[0].text == ask(vlm_client, data_url(CAT)).choices[0].message.content
    by_url = a.messages.create(model="gemma3_vlm", max_tokens=MAX_TOKENS, extra_body={"temperature": 0.0}, messages=[{
        "role": "user", "content": [{"type": "image", "source": {"type": "url", "url": media + "/cat.png"}},
                                    {"type": "text", "text": "the cat"}]}])
    assert by_url.content[0].text == msg.content[0].text


def test_responses_input_image_gets_the_same_answer(vlm_client):
    r = vlm_client.responses.create(model="gemma3_vlm", max_output_tokens=MAX_TOKENS, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_image", "image_url": data_url(CAT)},
                                    {"type": "input_text", "text": "the cat"}]}])
    assert r.output_text == ask(vlm_client, data_url(CAT)).choices[0].message.content


BAD = [  # (image URL, what the 400 says)
    (data_url(CAT[: len(CAT) // 2]), "cannot be decoded"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("{media}/slow.png", "could not be fetched"),
    ("{media}/loop", "redirects"),
    ("{media}/big.png", "larger than"),
    ("http://localhost:1/cat.png", "allowed-media-domains"),
    ("file:///etc/passwd", "allowed-local-media-path"),
]


def test_bad_images_and_urls_are_400s_and_the_server_goes_on(served, vlm_client, media):
    def post(body):
        return httpx.post(served[1].url + "/v1/chat/completions", timeout=30,
                          json={"model": "gemma3_vlm", "max_tokens": 2, **body})

    for url, says in BAD:
        r = post({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url.format(media=media)}}, {"type": "text", "text": "x"}]}]})
        assert says in assert_error(r, anthropic=False)["message"], url
    part = {"type": "image_url", "image_url": {"url": data_url(CAT)}}
    r = post({"messages": [{"role": "user", "content": [part, part, part]}]})
    assert "at most 2" in assert_error(r, anthropic=False)["message"]
    r = post({"truncate_prompt_tokens": 8, "messages": [{"role": "user", "content": [part]}]})
    assert "cannot cut a prompt with images" in assert_error(r, anthropic=False)["message"]
    assert ask(vlm_client, data_url(CAT)).choices[0].message.content == expected_text(served[0], CAT)


def test_a_photo_past_qwen_vls_bound_is_downscaled_to_it_and_answers_as_the_photo_resized_beforehand(qwen_photos):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    path, serve = qwen_photos
    client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    bound = 1280 * 16 ** 2  # Qwen's 1280 image tokens of the tiny tower's 8x8 patches merged 2x2
    # A smooth 1600x1200 photo (JPEG keeps it small), six times the bound.
    photo = random_image(4, (40, 30)).resize((1600, 1200), Image.BICUBIC)
    buf = io.BytesIO()
    photo.save(buf, "JPEG", quality=90)
    jpeg = buf.getvalue()
    h, w = smart_resize(1200, 1600, factor=16, min_pixels=16 * 16, max_pixels=bound)
    resized = png(Image.open(io.BytesIO(jpeg)).convert("RGB").resize((w, h), Image.BICUBIC))
    big = ask(client, data_url(jpeg, "jpeg"), model="qwen_photos")
    assert big.choices[0].message.content == expected_text(path, resized)
    small = ask(client, data_url(resized), model="qwen_photos")
    assert small.choices[0].message.content == big.choices[0].message.content
    assert big.usage.prompt_tokens == small.usage.prompt_tokens > h * w // 16 ** 2


def test_an_image_to_a_text_only_model_is_a_400_naming_it(gateway, model):
    r = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
        "model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(CAT)}}]}]})
    assert f"`{model}` does not take images" in assert_error(r, anthropic=False)["message"]

