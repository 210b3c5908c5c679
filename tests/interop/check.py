#!/usr/bin/env python3
"""Reads Strata's native and speculators outputs with the `safetensors` and
`numpy` packages (as a training stack would) and checks shapes and values
against the HF reference of the fixture. Run by tests/interop.rs.

    check.py NATIVE_DIR SPECULATORS_DIR FIXTURE_DIR
"""
import json
import os
import sys

import numpy as np
from safetensors import safe_open


def load_any(path):
    """All tensors of a file; bf16 (which numpy lacks) decoded from the raw bytes."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    np_types = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "U8": np.uint8}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[a:b]
        if info["dtype"] == "BF16":
            arr = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, np_types[info["dtype"]])
        out[name] = arr.reshape(info["shape"])
    # The safetensors package must agree on names and shapes.
    with safe_open(path, framework="numpy") as f:
        assert set(f.keys()) == set(out), (sorted(f.keys()), sorted(out))
        for k in f.keys():
            assert list(f.get_slice(k).get_shape()) == list(out[k].shape), k
    return out


def main():
    native, spec, fixture = sys.argv[1:4]
    manifest = json.load(open(os.path.join(native, "manifest.json")))
    expected = load_any(os.path.join(fixture, "expected.safetensors"))
    samples = [json.loads(l) for l in open(os.path.join(fixture, "data.jsonl"))]
    L = len(manifest["capture"])
    H = manifest["model"]["hidden_size"]
    tol = {"f32": 1e-4, "f16": 2e-3, "bf16": 1.6e-2}[manifest["dtype"]]
    shards = {}
    for s in manifest["samples"]:
        shard = manifest["shards"][s["shard"]]["file"]
        if shard not in shards:
            shards[shard] = load_any(os.path.join(native, shard))
    checked = 0
    for i, (info, line) in enumerate(zip(manifest["samples"], samples)):
        ids = np.array(line["input_ids"])
        T = len(ids)
        t = shards[manifest["shards"][info["shard"]]["file"]]
        hs = t[info["id"] + ".hidden_states"]
        assert hs.shape == (L, T, H), (info["id"], hs.shape)
        assert (t[info["id"] + ".input_ids"] == ids).all()
        assert (t[info["id"] + ".loss_mask"] == 1).all()
        sp = load_any(os.path.join(spec, "hidden_states", f"hs_{i}.safetensors"))
        assert sp["hidden_states"].shape == (T, L, H)
        assert (sp["token_ids"] == ids).all()
        assert np.array_equal(sp["hidden_states"].transpose(1, 0, 2), hs), "native and speculators disagree"
        for l, cap in enumerate(manifest["capture"]):
            k = cap["hf_index"]
            ref = expected[f"sample{i}.hidden_states"][k] if k is not None else expected[f"sample{i}.final_pre_norm"]
            err = np.max(np.abs(hs[l].astype(np.float64) - ref) / np.maximum(1.0, np.abs(ref)))
            assert err <= tol, (info["id"], cap["point"], err)
            checked += 1
    print(f"interop ok: {len(samples)} samples, {checked} captured layers checked ({manifest['dtype']})")


if __name__ == "__main__":
    main()
