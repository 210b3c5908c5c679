#!/usr/bin/env python3
"""Hugging Face `datasets` interop for tests/interop.rs.

    datasets_check.py write DIR ROWS.json   # a save_to_disk dataset as the speculators prepare step writes it
    datasets_check.py read OUT ROWS.json    # OUT (strata --format speculators) read with datasets.load_from_disk

ROWS.json is a list of {"input_ids": [...], "loss_mask": [...]}. `write`
stores input_ids as int32 lists (as the speculators prepare step does),
loss_mask as int64 lists, seq_len as int64, with the torch format set.
`read` checks that row i of the table holds ROWS[i], that
hidden_states/hs_{i}.safetensors holds the same token ids and mask, and that
its hidden_states are [T, L, H]. load_from_disk applies the table's torch
format, which needs torch: without torch, `read` checks that load_from_disk
stops only for that reason and reads the same table with Dataset.from_file.
"""
import json
import os
import struct
import sys

import datasets
from safetensors import safe_open


def write(dirname, rows):
    ds = datasets.Dataset.from_dict({
        "input_ids": [r["input_ids"] for r in rows],
        "loss_mask": [r["loss_mask"] for r in rows],
        "seq_len": [len(r["input_ids"]) for r in rows],
    })
    ds = ds.cast(datasets.Features({
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int64")),
        "seq_len": datasets.Value("int64"),
    }))
    try:
        import torch  # noqa: F401
        ds.set_format("torch")
    except ImportError:
        ds.set_format("numpy")
    ds.save_to_disk(dirname)
    print(f"wrote {len(rows)} rows to {dirname}")


def header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def read(out, rows):
    state = json.load(open(os.path.join(out, "state.json")))
    assert state["_format_type"] == "torch", state
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    if have_torch:
        ds = datasets.load_from_disk(out)
        assert ds.format["type"] == "torch", ds.format
        got = [{k: ds[i][k].tolist() for k in ("input_ids", "loss_mask", "seq_len")} for i in range(len(ds))]
        how = "datasets.load_from_disk (torch format)"
    else:
        try:
            datasets.load_from_disk(out)
            raise AssertionError("load_from_disk applied the torch format without torch")
        except ValueError as e:
            assert "PyTorch" in str(e), e
        info = json.load(open(os.path.join(out, "dataset_info.json")))
        parts = [datasets.Dataset.from_file(os.path.join(out, f["filename"])) for f in state["_data_files"]]
        ds = datasets.concatenate_datasets(parts)
        assert ds.features == datasets.Features.from_dict(info["features"]), (ds.features, info["features"])
        got = [ds[i] for i in range(len(ds))]
        how = "Dataset.from_file (torch is not installed: load_from_disk stops at the torch format, as it must)"
    assert len(got) == len(rows), (len(got), len(rows))
    for i, (g, want) in enumerate(zip(got, rows)):
        assert g["input_ids"] == want["input_ids"], (i, g["input_ids"], want["input_ids"])
        assert g["loss_mask"] == want["loss_mask"], (i, g["loss_mask"], want["loss_mask"])
        assert g["seq_len"] == len(want["input_ids"]), i
        path = os.path.join(out, "hidden_states", f"hs_{i}.safetensors")
        with safe_open(path, framework="numpy") as f:
            assert f.get_tensor("token_ids").tolist() == want["input_ids"], i
            assert f.get_tensor("loss_mask").tolist() == want["loss_mask"], i
        hs = header(path)["hidden_states"]["shape"]
        assert hs[0] == len(want["input_ids"]), (i, hs)
    extra = os.path.join(out, "hidden_states", f"hs_{len(rows)}.safetensors")
    assert not os.path.exists(extra), extra
    print(f"datasets interop ok: {len(rows)} rows read with {how}; hidden_states/hs_i match row i")


def main():
    cmd, path, rows = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
    {"write": write, "read": read}[cmd](path, rows)


if __name__ == "__main__":
    main()
