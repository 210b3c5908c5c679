"""FP8 hidden states as Python reads them: safetensors with torch's
float8_e4m3fn (numpy cannot hold e4m3), times hidden_states_scales, must
equal what Strata decodes (`strata inspect`/`verify`'s decoding, written by
the Rust test to DECODED). Without torch, the codes are decoded with a table
built from the e4m3fn definition instead, and the output says so.

usage: fp8_check.py NATIVE_DIR SPECULATORS_DIR DECODED.safetensors
"""
import json
import struct
import sys

import numpy as np
from safetensors.numpy import load_file

try:
    import torch
    from safetensors.torch import load_file as load_torch
except ImportError:
    torch = None


def e4m3fn_table():
    t = np.zeros(256, dtype=np.float32)
    for c in range(256):
        s = -1.0 if c & 0x80 else 1.0
        e, m = (c >> 3) & 0xF, c & 7
        if e == 0xF and m == 7:
            t[c] = np.nan
        elif e == 0:
            t[c] = s * m / 8.0 * 2.0**-6
        else:
            t[c] = s * (1 + m / 8.0) * 2.0 ** (e - 7)
    return t


TABLE = e4m3fn_table()


def raw_tensors(path):
    """name -> (dtype, shape, bytes), from the safetensors header itself."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def dequantised(path, name):
    """hidden_states * hidden_states_scales of tensor `name` in `path`, as float32 numpy."""
    raw = raw_tensors(path)
    dtype, shape, codes = raw[name]
    assert dtype == "F8_E4M3", (name, dtype)
    sd, sshape, sbytes = raw[name + "_scales"]
    assert sd == "F32" and sshape == shape[:-1] + [1], (sd, sshape, shape)
    c = np.frombuffer(codes, dtype=np.uint8)
    assert not np.any((c & 0x7F) == 0x7F), "a NaN code"
    scales = np.frombuffer(sbytes, dtype=np.float32).reshape(sshape)
    assert np.all(np.isfinite(scales)) and np.all(scales > 0), "a scale that is not finite and positive"
    if torch is not None:
        t = load_torch(path)
        assert t[name].dtype == torch.float8_e4m3fn, t[name].dtype
        return (t[name].float() * t[name + "_scales"]).numpy()
    return TABLE[c].reshape(shape) * scales


def main(native, spec, decoded):
    want = load_file(decoded)
    manifest = json.load(open(f"{native}/manifest.json"))
    n = 0
    for s in manifest["samples"]:
        shard = f"{native}/{manifest['shards'][s['shard']]['file']}"
        got = dequantised(shard, f"{s['id']}.hidden_states")
        w = want[s["id"]]
        assert got.shape == w.shape and np.array_equal(got, w), f"native sample {s['id']} differs"
        # The speculators file of the same row: [T, L, H] with [T, L, 1] scales.
        hs = dequantised(f"{spec}/hidden_states/hs_{n}.safetensors", "hidden_states")
        assert np.array_equal(hs.transpose(1, 0, 2), w), f"speculators row {n} differs"
        n += 1
    how = "torch float8_e4m3fn" if torch is not None else "an e4m3fn table in numpy (torch is not installed)"
    print(f"fp8: {n} samples in both formats equal Strata's decoding, read with {how}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
