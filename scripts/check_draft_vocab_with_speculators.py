"""Checks `strata extract --format speculators --draft-vocab-size N` output
against speculators' own code (0.9): its token counter
(`save_token_frequency_distribution`, on the table through `datasets`) and
its mapping builder (`build_vocab_mappings_from_distribution`).

Needs speculators and torch installed (not in CI: tests/interop.rs checks
the same files against an independent computation without torch).

    python scripts/check_draft_vocab_with_speculators.py OUT VOCAB_SIZE
"""

import io
import sys
import tempfile
from pathlib import Path

import datasets
import numpy as np
import torch
from speculators.train.vocab_mapping import (
    build_vocab_mappings_from_distribution,
    save_token_frequency_distribution,
)

out, vocab = Path(sys.argv[1]), int(sys.argv[2])
ds = datasets.load_from_disk(str(out))
ds.set_format("torch")
with tempfile.TemporaryDirectory() as tmp:
    theirs_path = Path(tmp) / "token_freq.pt"
    save_token_frequency_distribution(ds, theirs_path)
    theirs = torch.load(theirs_path, weights_only=True)
ours = torch.load(out / "token_freq.pt", weights_only=True)
assert ours == theirs, "token_freq.pt differs from speculators' count"
print(f"token_freq.pt: torch.load(weights_only=True) equals speculators' count ({len(ours)} tokens, {len(ds)} rows)")

sizes = sorted(int(p.name[4:-4]) for p in out.glob("d2t-*.npy"))
assert sizes, "no d2t-N.npy"
for n in sizes:
    d2t, t2d = build_vocab_mappings_from_distribution(theirs, n, vocab)
    for name, want in [(f"d2t-{n}.npy", d2t.numpy()), (f"t2d-{n}.npy", t2d.numpy())]:
        data = (out / name).read_bytes()
        buf = io.BytesIO()
        np.save(buf, want)
        assert data == buf.getvalue(), f"{name} is not what speculators builds"
    print(f"N={n}: d2t-{n}.npy and t2d-{n}.npy are the bytes of speculators' mappings, saved by numpy")
print("ok")
