"""Checks the speculators trainer's draft-vocabulary files that
`strata extract --draft-vocab-size` wrote, against a computation made here
from the input rows alone (not from Strata's table):

    draft_vocab_check.py OUT ROWS.json VOCAB N[,N...] LAYER_IDS

- token_freq.pt: a zip archive (read with zipfile) whose data.pkl (read with
  pickle) is the dict {token id: count of loss-masked occurrences}; where
  torch is installed, torch.load(weights_only=True) gives the same dict.
- d2t-N.npy / t2d-N.npy: the rule of speculators' build_vocab_mappings_from_
  distribution, written out here: ids by count descending, ties by id, the
  first N; fewer seen than N: the lowest unused ids fill up; sorted. d2t is
  int64 [N] of id - index, t2d bool [V]. The files are numpy.save's bytes.
- dataset_info.json records the layer ids, and datasets still loads the table.
"""

import io
import json
import pickle
import sys
import zipfile
from collections import Counter

import numpy as np

out, rows_path, vocab, sizes, layer_ids = sys.argv[1:6]
vocab = int(vocab)
sizes = [int(n) for n in sizes.split(",")]
layer_ids = [int(i) for i in layer_ids.split(",")]
rows = [json.loads(line) for line in open(rows_path) if line.strip()]

counts = Counter()
for r in rows:
    mask = r.get("loss_mask") or [1] * len(r["input_ids"])
    counts.update(t for t, m in zip(r["input_ids"], mask) if m)
counts = dict(counts)

with zipfile.ZipFile(f"{out}/token_freq.pt") as z:
    names = z.namelist()
    pkl = [n for n in names if n.endswith("/data.pkl")]
    assert len(pkl) == 1 and any(n.endswith("/version") for n in names), names
    assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
    got = pickle.loads(z.read(pkl[0]))
assert got == counts, (got, counts)
try:
    import torch
except ImportError:
    print("torch is not installed: torch.load not checked (zipfile and pickle were)")
else:
    loaded = torch.load(f"{out}/token_freq.pt", weights_only=True)
    assert loaded == counts
    print("torch.load(weights_only=True) gives the counts")

ties = sum(1 for c in Counter(counts.values()).values() if c > 1)
for n in sizes:
    chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))][:n]
    fill = iter(t for t in range(vocab) if t not in set(chosen))
    while len(chosen) < n:
        chosen.append(next(fill))
    chosen.sort()
    d2t = np.array(chosen, dtype=np.int64) - np.arange(n, dtype=np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[chosen] = True
    for name, want in [(f"d2t-{n}.npy", d2t), (f"t2d-{n}.npy", t2d)]:
        data = open(f"{out}/{name}", "rb").read()
        a = np.load(io.BytesIO(data))
        assert a.dtype == want.dtype and a.shape == want.shape and (a == want).all(), (name, a, want)
        buf = io.BytesIO()
        np.save(buf, want)
        assert data == buf.getvalue(), f"{name} is not numpy.save's bytes"
    print(f"N={n}: {len(counts)} tokens seen, {ties} tied counts, {max(0, n - len(counts))} filled")

info = json.load(open(f"{out}/dataset_info.json"))
assert info["strata"]["layer_ids"] == layer_ids, info["strata"]
assert info["strata"]["target_layer_ids"] == layer_ids[:-1], info["strata"]
import datasets

# datasets reads the info with the `strata` entry (it keeps the fields it knows).
parsed = datasets.DatasetInfo.from_directory(out)
assert parsed.features == datasets.Features.from_dict(info["features"]), parsed.features
try:
    import torch  # noqa: F401, F811
except ImportError:
    # load_from_disk applies the table's torch format, which needs torch.
    state = json.load(open(f"{out}/state.json"))
    ds = datasets.concatenate_datasets([datasets.Dataset.from_file(f"{out}/{f['filename']}") for f in state["_data_files"]])
    print("torch is not installed: the table read with Dataset.from_file, the info with DatasetInfo.from_directory")
else:
    ds = datasets.load_from_disk(out)
assert len(ds) == len(rows)
print("ok")
