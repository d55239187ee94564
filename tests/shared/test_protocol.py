"""Wire structs round-trip; anything else is a MalformedFrame; hot-path layouts stay append-only."""

from __future__ import annotations

import msgspec
import pytest

from mlxd.shared import protocol as p
from mlxd.shared.protocol import Kind, SamplingParams

EXAMPLES = {
    Kind.HELLO: p.Hello(protocol_version=p.PROTOCOL_VERSION, pid=3),
    Kind.READY: p.EngineInfo(protocol_version=1, engine_version="0.1", instance_id="abc", model_id="m",
                             served_model_name="m", tokenizer_dir="/t", max_model_len=512, block_size=16,
                             num_kv_blocks=8, vocab_size=100, eos_token_ids=[2]),
    Kind.ADD: p.AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4, seed=9, logit_bias={5: -1.0}),
                           lora_name="sql"),
    Kind.ABORT: p.Abort(["r1", "r2"]),
    Kind.OUTPUTS: p.StepOutputs([p.RequestOutput("r1", [7, 2], "stop", [p.Logprob(-0.5, [7], [-0.5])],
                                                 3, 0, 2)]),
    Kind.ERROR: p.Error(request_id="r1", code="invalid_request", message="bad", param="max_tokens"),
    Kind.PING: p.Ping(1.5),
    Kind.PONG: p.Pong("abc", 1.5, p.EngineStats(1, 2, 3, 4), [p.LoraAdapter(name="sql", path="/a")]),
    Kind.DEAD: p.Dead(reason="bye"),
    Kind.BYE: p.Bye(),
    Kind.LORA: p.LoraUpdate(op_id="lora-1", action="load", lora_name="sql", lora_path="/a"),
    Kind.LORA_DONE: p.LoraAdapters(op_id="lora-1", adapters=[p.LoraAdapter(name="sql", path="/a")]),
}


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_round_trips(kind):
    assert p.decode(p.encode(kind, EXAMPLES[kind])) == (kind, EXAMPLES[kind])


@pytest.mark.parametrize("frames", [
    [], [b"\x03"], [b"\x03", b"", b""], [b"\x7f", b"\x90"], [b"", b"\x90"],
    [Kind.ADD.value, b"\xc1"], [Kind.ADD.value, msgspec.msgpack.encode({"request_id": "x"})],
    [Kind.ABORT.value, msgspec.msgpack.encode([[1, 2]])],
])
def test_anything_else_is_malformed(frames):
    with pytest.raises(p.MalformedFrame):
        p.decode(frames)


def test_request_output_layout_is_positional_and_append_only():
    # Peers of different builds decode by position: these indexes must never move.
    out = p.RequestOutput("r", [1], "length", None, 5, 2, None)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out)) == ["r", [1], "length", None, 5, 2, None, None, None,
                                                                   None, None]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p.Logprob(-1.0, [3], [-1.0]))) == [-1.0, [3], [-1.0]]
    add = msgspec.msgpack.decode(msgspec.msgpack.encode(p.AddRequest("r", [1], SamplingParams())))
    assert add[:2] == ["r", [1]]


def test_a_shorter_array_from_an_older_peer_still_decodes_with_defaults():
    older = msgspec.msgpack.encode(["r", [1, 2], None])
    kind, msg = p.decode([Kind.OUTPUTS.value, msgspec.msgpack.encode([[msgspec.msgpack.decode(older)]])])
    assert msg.outputs[0].num_cached_tokens == 0 and msg.outputs[0].stop_token_id is None


def test_add_request_carries_app_and_priority_after_the_salt():
    add = p.AddRequest("r", [1], SamplingParams(), "salt", "app-a", -3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(add))[3:12] == ["salt", "app-a", -3, None, 1, 1, 0, "generate",
                                                                         None]
    kind, msg = p.decode(p.encode(Kind.ADD, add))
    assert (msg.app, msg.priority) == ("app-a", -3)
    # An AddRequest of protocol 1 (no app, no priority) decodes with the defaults.
    older = msgspec.msgpack.encode(["r", [1], msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams())), None])
    kind, msg = p.decode([Kind.ADD.value, older])
    assert msg.app is None and msg.priority == 0 and msg.group is None and msg.group_size == 1
    assert msg.lora_name is None


def test_images_travel_after_the_older_fields_and_decode_whole():
    image = p.ImageInput("ab" * 32, 5, 16, [3, 2, 2], bytes(48))
    add = p.AddRequest("r", [1] * 30, SamplingParams(), images=[image])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(add))[12] == [["ab" * 32, 5, 16, [3, 2, 2], bytes(48), None]]
    assert p.decode(p.encode(Kind.ADD, add))[1].images == [image]
    # An image with markers between its runs of rows, and tiles: the runs after the older fields.
    tiled = p.ImageInput("cd" * 32, 5, 9, [2, 3, 2, 2], bytes(96), [[0, 4], [5, 4]])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(tiled))[5] == [[0, 4], [5, 4]]
    assert p.decode(p.encode(Kind.ADD, p.AddRequest("r", [1] * 30, SamplingParams(), images=[tiled])))[1].images == [tiled]


def test_pooled_requests_carry_their_task_and_results_after_the_older_fields():
    add = p.AddRequest("r", [1], SamplingParams(), task="embed")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(add))[10] == "embed"  # lora_name and later came after it
    assert p.decode(p.encode(Kind.ADD, add))[1].task == "embed"
    out = p.RequestOutput("r", [], "stop", embedding=b"\x00\x00\x80?", score=0.25)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out))[7:9] == [b"\x00\x00\x80?", 0.25]
    # An engine of protocol 4 or older sends no tasks: its model is a generation model.
    info = p.ModelInfo(model_id="m", served_model_name="m", tokenizer_dir="/t", max_model_len=8, block_size=16,
                       num_kv_blocks=1, vocab_size=4, eos_token_ids=[])
    assert info.tasks == ["generate"] and info.embedding_dim == 0 and info.matryoshka_dimensions is None
