"""LoRA end to end through the openai SDK: a base model and two adapters served at once by real processes.

Each name answers as itself and `/v1/models` lists the adapters with their
parent; an adapter loaded at runtime from A's files answers exactly as A, and
is gone after it is unloaded; a bad adapter path is a 404, a bad adapter a 400,
both with the reason; `cached_tokens` shows the prefix cache shared within an
adapter and never across adapters. An app key limited to some adapters (`mlxd keys add --loras`) sees
and uses only those: any other is a 404 as for a model that does not exist, on every route, and a 403 for
loading or unloading it.
"""

from __future__ import annotations

import time

import anthropic
import httpx
import numpy as np
import openai
import pytest

from mlxd.engined.loaders import load_model
from mlxd import cli
from tests.e2e.servers import Engine, Gateway, free_port
from tests.engined.test_lora import random_adapter, write_mlx_lm, write_peft
from tests.tiny_models import fresh_seed, make_tiny_model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-e2e")
    seed = fresh_seed("lora e2e")
    rng = np.random.default_rng(seed)
    model_dir = make_tiny_model(root / "model", "llama", seed=seed % (1 << 30))
    model = load_model(str(model_dir)).model
    a_dir = write_mlx_lm(root / "a", random_adapter(model, 4, rng), scale=2.0, num_layers=2)
    b_dir = write_peft(root / "b", random_adapter(model, 8, rng), alpha=16.0, rank=8)
    engine = Engine(f"tcp://127.0.0.1:{free_port()}", str(root / "engine.log"), extra=[
        "--model", str(model_dir), "--served-model-name", "base", "--enable-lora",
        "--lora-modules", f"A={a_dir}", f'{{"name": "B", "path": "{b_dir}"}}',
        "--max-loras", "2", "--max-lora-rank", "8"]).start()
    gateway = Gateway(engine.endpoint, str(root / "gateway.log"), extra=["--enable-runtime-lora-updating"]).start()
    try:
        gateway.wait_healthy()
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, gateway, a_dir, root
    finally:
        gateway.stop()
        engine.stop()


def _complete(client, model, prompt="The quick brown fox", **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0, **kw)


def test_base_and_two_adapters_answer_under_their_own_names_and_are_listed(served):
    client, _, a_dir, _ = served
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "A", "B"}
    assert cards["A"].parent == cards["B"].parent == "base" and cards["A"].root == str(a_dir)
    assert getattr(cards["base"], "parent", None) is None
    assert client.models.retrieve("B").parent == "base"
    texts = {}
    for name in ("base", "A", "B"):
        out = _complete(client, name)
        assert out.model == name
        texts[name] = out.choices[0].text
    assert len(set(texts.values())) == 3, texts
    chat = client.chat.completions.create(model="A", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0.0)
    assert chat.model == "A"
    with pytest.raises(openai.NotFoundError, match="LoRA adapters `A`, `B`"):
        _complete(client, "C")


def test_runtime_load_answers_as_the_same_files_and_unload_removes_it(served):
    client, gateway, a_dir, _ = served
    r = httpx.post(gateway.url + "/v1/load_lora_adapter", json={"lora_name": "A2", "lora_path": str(a_dir)})
    assert r.status_code == 200, r.text
    assert "A2" in {m.id for m in client.models.list().data}
    assert _complete(client, "A2").choices[0].text == _complete(client, "A").choices[0].text
    r = httpx.post(gateway.url + "/v1/unload_lora_adapter", json={"lora_name": "A2"})
    assert r.status_code == 200, r.text
    assert "A2" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        _complete(client, "A2")
    r = httpx.post(gateway.url + "/v1/unload_lora_adapter", json={"lora_name": "A2"})
    assert r.status_code == 404 and "no LoRA adapter named 'A2'" in r.json()["error"]["message"]


def test_bad_adapter_path_is_404_and_a_bad_adapter_400_with_the_reason(served):
    _, gateway, _, root = served
    r = httpx.post(gateway.url + "/v1/load_lora_adapter", json={"lora_name": "X", "lora_path": str(root / "nope")})
    assert r.status_code == 404 and "not a directory" in r.json()["error"]["message"]
    wrong = {"model.layers.0.self_attn.q_proj": (np.zeros((8, 2), np.float32), np.zeros((2, 64), np.float32))}
    bad = write_mlx_lm(root / "wrong", wrong, 1.0, 2)
    r = httpx.post(gateway.url + "/v1/load_lora_adapter", json={"lora_name": "X", "lora_path": str(bad)})
    assert r.status_code == 400 and "the model needs" in r.json()["error"]["message"]
    r = httpx.post(gateway.url + "/v1/load_lora_adapter", json={"lora_name": "X"})
    assert r.status_code == 400
    assert gateway.health().status_code == 200


def test_cached_tokens_show_prefix_sharing_within_an_adapter_never_across(served):
    client, _, _, _ = served
    prompt = " ".join(f"word{i}" for i in range(30))  # well over two 16-token blocks

    def cached(model):
        return _complete(client, model, prompt=prompt).usage.prompt_tokens_details.cached_tokens

    assert cached("A") == 0
    assert cached("A") > 0
    assert cached("B") == 0
    assert cached("base") == 0
    assert cached("B") > 0


def test_runtime_updates_are_refused_without_the_flag(tmp_path):
    # The routes answer 403 naming the flag; a gateway needs no engine to say so.
    gateway = Gateway(f"tcp://127.0.0.1:{free_port()}", str(tmp_path / "gateway.log")).start()
    try:
        for _ in range(600):  # until it listens
            try:
                r = httpx.post(gateway.url + "/v1/load_lora_adapter", json={"lora_name": "A", "lora_path": "/x"},
                               timeout=30)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert r.status_code == 403 and "--enable-runtime-lora-updating" in r.json()["error"]["message"]
    finally:
        gateway.stop()


def test_a_key_limited_to_some_adapters_sees_and_uses_only_those(served, tmp_path, capsys):
    client, gateway, _, _ = served
    keys_file = str(tmp_path / "keys.json")

    def add(app, *loras):
        assert cli.main(["keys", "add", app, "--keys-file", keys_file, *(["--loras", *loras] if loras else [])]) == 0
        return capsys.readouterr().out.strip()

    shop, lab = add("shop", "A"), add("lab")
    assert cli.main(["keys", "add", "basic", "--keys-file", keys_file, "--loras"]) == 0  # the base model only
    basic = capsys.readouterr().out.strip()
    assert cli.main(["keys", "list", "--keys-file", keys_file]) == 0
    assert [line.split("\t")[-1] for line in capsys.readouterr().out.splitlines()] == [
        "adapters: A", "any adapter", "adapters: none"]
    # A second gateway on the same engine, with the keys.
    keyed = Gateway(gateway.endpoint, str(tmp_path / "gateway.log"),
                    extra=["--keys-file", keys_file, "--enable-runtime-lora-updating"]).start()
    try:
        keyed.wait_healthy()

        def sdk(key):
            return openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0, timeout=120)

        def listed(key):
            return sorted(m.id for m in sdk(key).models.list().data)

        assert listed(shop) == ["A", "base"] and listed(lab) == ["A", "B", "base"] and listed(basic) == ["base"]
        assert _complete(sdk(shop), "A").choices[0].text == _complete(client, "A").choices[0].text
        assert _complete(sdk(shop), "base").choices[0].text == _complete(client, "base").choices[0].text
        assert _complete(sdk(lab), "B").choices[0].text == _complete(client, "B").choices[0].text
        # B for shop: what a model that does not exist gets, naming only what shop may use.
        with pytest.raises(openai.NotFoundError, match="LoRA adapters `A`[.]") as e:
            _complete(sdk(shop), "B")
        assert "does not exist or you do not have access to it" in str(e.value)
        with pytest.raises(openai.NotFoundError):
            sdk(shop).chat.completions.create(model="B", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            sdk(shop).models.retrieve("B")
        with pytest.raises(openai.NotFoundError, match="this server serves `base`[.]"):
            _complete(sdk(basic), "A")
        with pytest.raises(anthropic.NotFoundError):
            anthropic.Anthropic(base_url=keyed.url, api_key=shop, max_retries=0).messages.create(
                model="B", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        r = httpx.post(keyed.url + "/v1/unload_lora_adapter", json={"lora_name": "B"},
                       headers={"Authorization": f"Bearer {shop}"})
        assert r.status_code == 403 and "may not load or unload the LoRA adapter 'B'" in r.json()["error"]["message"]
        assert "B" in {m.id for m in client.models.list().data}  # still served
        # Changed for the running gateway, as a revoked key is: shop now has B and not A.
        assert cli.main(["keys", "loras", "shop", "B", "--keys-file", keys_file]) == 0
        assert listed(shop) == ["B", "base"]
        assert _complete(sdk(shop), "B").choices[0].text == _complete(client, "B").choices[0].text
        with pytest.raises(openai.NotFoundError):
            _complete(sdk(shop), "A")
        assert cli.main(["keys", "loras", "shop", "--any", "--keys-file", keys_file]) == 0
        assert listed(shop) == ["A", "B", "base"]
        with pytest.raises(openai.AuthenticationError):
            sdk("mlxd_nope_nope").models.list()
    finally:
        keyed.stop()
