"""Where the first token of one long prompt goes: the engine (``dummy:llama3.1-8b``, its
default 2,048-token prefill steps, prefix caching off) prefills a random prompt of N tokens
twice, then once more under the torch profiler; GPU kernel time by kernel name, and every
kernel's total in a JSON file (docs/benchmarks/kernels.md, session 21).

    python3 docs/benchmarks/ttft_profile.py 32768 prof32.json
    python3 docs/benchmarks/ttft_profile.py 131071 prof128.json
"""

import collections
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flashserve.bench.prefill import time_ours
from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLMEngine

n = int(sys.argv[1])
cfg = EngineConfig(model="dummy:llama3.1-8b", max_model_len=min(n + 1, 131072), max_num_seqs=1,
                   max_kv_tokens=-(-(n + 1) // 128) * 128, enable_prefix_caching=False)  # fmt: skip
eng = LLMEngine(cfg)
g = torch.Generator().manual_seed(0)


def ids() -> list[int]:
    return torch.randint(0, 128000, (n,), generator=g).tolist()


print("warm", time_ours(eng, ids()), "plain", time_ours(eng, ids()), flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t = time_ours(eng, ids())
print("profiled", t)
tot: collections.Counter = collections.Counter()
cnt: collections.Counter = collections.Counter()
for e in prof.events():
    if e.device_type.name == "CUDA":
        name = e.name[:90]
        tot[name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        cnt[name] += 1
allt = sum(tot.values())
print(f"GPU kernel time {allt / 1e3:.1f} ms over wall {t * 1e3:.1f} ms")
for name, us in tot.most_common(25):
    print(f"{us / 1e3:9.2f} ms {100 * us / allt:5.1f}% {cnt[name]:6d}  {name}")
json.dump({"n": n, "wall_s": t, "kernels": {k: [v, cnt[k]] for k, v in tot.items()}},
          open(sys.argv[2], "w"), indent=1)  # fmt: skip
