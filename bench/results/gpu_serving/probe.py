import cProfile, pstats, time, sys
import numpy as np
import mlx.core as mx
# 1. does creating a host array wait for queued device work?
a = mx.random.normal((8192, 8192)).astype(mx.bfloat16); mx.eval(a)
def chain():
    x = a
    for _ in range(40): x = x @ a
    return x
mx.eval(chain())
t0 = time.perf_counter(); y = chain(); mx.async_eval(y); t1 = time.perf_counter()
z = mx.array(np.arange(16, dtype=np.int32)); t2 = time.perf_counter()
w = mx.zeros((16,)); t2b = time.perf_counter()
mx.eval(y); t3 = time.perf_counter()
print(f"async_eval launch {1e3*(t1-t0):.2f} ms; mx.array(np) {1e3*(t2-t1):.2f} ms; mx.zeros {1e3*(t2b-t2):.3f}; rest of chain {1e3*(t3-t2b):.2f} ms", flush=True)
y = chain(); mx.async_eval(y); t1 = time.perf_counter()
q = a[mx.array([1, 2, 3])]; t2 = time.perf_counter(); mx.eval(y); t3 = time.perf_counter()
print(f"index with a new host array {1e3*(t2-t1):.2f} ms, rest {1e3*(t3-t2):.2f}", flush=True)
# 2. profile the engine's step at c=64 decode
from bench.gpu_serving import build_models, engine_for
from shared.protocol import SamplingParams
class A: max_num_batched_tokens = 8192; num_kv_blocks = 8192
model, make_loaded, n = build_models("qwen3-8b", "bf16", 0)
for mode in (False, True):
    e = engine_for(make_loaded, A, 64, mode)
    rng = np.random.default_rng(0)
    p = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i in range(64): e.add_request(f"r{i}", rng.integers(0, 150000, 512).tolist(), p)
    for _ in range(30): e.step()
    pr = cProfile.Profile(); w0 = e.sync_wait_s; t0 = time.perf_counter()
    pr.enable()
    for _ in range(40): e.step()
    pr.disable()
    dt = time.perf_counter() - t0
    print(f"async={mode}: {1e3*dt/40:.1f} ms/step (profiled), wait {1e3*(e.sync_wait_s-w0)/40:.1f} ms/step", flush=True)
    st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(22)
    t0 = time.perf_counter(); w0 = e.sync_wait_s
    for _ in range(40): e.step()
    print(f"async={mode}: {1e3*(time.perf_counter()-t0)/40:.1f} ms/step unprofiled, wait {1e3*(e.sync_wait_s-w0)/40:.1f}", flush=True)
    e.abort(list(e.requests)); 
    while e.has_unfinished(): e.step()
    del e; mx.clear_cache()
