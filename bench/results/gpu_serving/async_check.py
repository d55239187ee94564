"""On the GPU: the async/sync equivalence test's workload through the CUDA kernel (auto backend)."""
import sys
import tests.engined.test_async_scheduling as t
from tests.tiny_models import make_tiny_model
import tempfile, pathlib
d = make_tiny_model(pathlib.Path(tempfile.mkdtemp()), "llama", seed=11, max_position_embeddings=4096)
for seed in (1, 2, 3):
    jobs = t.workload(seed)
    first, *_ = t.run(d, jobs, False, {}, "auto")
    stops = {rid: first[rid][3] for rid, _, _, kind in jobs if kind == 1 and len(first[rid]) > 3}
    s = t.run(d, jobs, False, stops, "auto"); a = t.run(d, jobs, True, stops, "auto")
    print("seed", seed, "tokens equal:", a[0] == s[0], "reasons equal:", a[1] == s[1], "preemptions", s[3], a[3], "overlapped", a[4], flush=True)
