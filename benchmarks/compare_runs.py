"""Compare TensorBoard scalars of two runs: every tag except timing/memory ones, every step, exact."""
import sys, glob, re
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TIMING = re.compile(r"(_time_s$|/rollout_s$|/update_s$|/wait_s$|tokens_per_s$|peak_memory|step_time_s$)")

def load(root):
    files = sorted(glob.glob(f"{root}/**/events.out.tfevents*", recursive=True))
    assert files, root
    out = {}
    for f in files:
        ea = EventAccumulator(f, size_guidance={"scalars": 0}); ea.Reload()
        for tag in ea.Tags()["scalars"]:
            for e in ea.Scalars(tag):
                out[(tag, e.step)] = e.value
    texts = {}
    for f in files:
        ea = EventAccumulator(f, size_guidance={"tensors": 0}); ea.Reload()
        for tag in ea.Tags().get("tensors", []):
            for e in ea.Tensors(tag):
                texts[(tag, e.step)] = bytes(e.tensor_proto.string_val[0]) if e.tensor_proto.string_val else None
    return out, texts

a, ta = load(sys.argv[1]); b, tb = load(sys.argv[2])
ka = {k for k in a if not TIMING.search(k[0])}; kb = {k for k in b if not TIMING.search(k[0])}
only_a, only_b = sorted(ka - kb), sorted(kb - ka)
diff = [(k, a[k], b[k]) for k in sorted(ka & kb) if a[k] != b[k] and not (a[k] != a[k] and b[k] != b[k])]
print(f"{sys.argv[1]} vs {sys.argv[2]}: {len(ka & kb)} common (tag, step) values, {len(diff)} differ, "
      f"{len(only_a)} only in first, {len(only_b)} only in second; texts {len(ta)} vs {len(tb)}, "
      f"{sum(1 for k in ta if tb.get(k) != ta[k])} differ")
for x in diff[:15]: print("  DIFF", x)
for x in only_a[:10]: print("  ONLY A", x)
for x in only_b[:10]: print("  ONLY B", x)
sys.exit(1 if diff or only_a or only_b else 0)
