#!/usr/bin/env python3
"""Check a running `strata serve` against the REAL speculators 0.9.0 client code.

Nothing here reimplements the protocol. Every step calls speculators' and
hs_connectors' own functions, the ones the trainer runs with --on-missing generate:

  1. client setup: speculators.train.data.ArrowDataset._setup_client. It builds
     openai.OpenAI(base_url, api_key="EMPTY", max_retries=0), calls models.list()
     and compares data[0].id with the model name. The check also passes a wrong
     name and expects the trainer's own ValueError.
  2. file backend: vllm_client.generate_hidden_states -> FileTransfer.get_generated
     -> offline.check_hidden_states -> FileTransfer.delete. The prompts are token
     ids of lengths 1..--max-len. Afterwards the served files (and .lock files)
     must be gone, and the directory holding them must be empty.
  3. fp8 backend (only with --fp8-url, a second server started with --dtype fp8):
     the same calls with hs_connectors.FP8Transfer. The dequantised states must be
     finite and close to the first server's (bf16) states for the same prompt.
     The error is reported relative to each token's amax. e4m3 rounds to at most
     2^-4 of a value, so the bound is 0.07 (--fp8-tol).
  4. (default; --skip-dataset skips it) the trainer's dataset item path:
     ArrowDataset(on_missing="generate") over a tiny on-disk dataset with the
     columns `speculators prepare-data` writes (input_ids, loss_mask, seq_len, torch
     format). Then CollateFn. It prints the aux/last-layer split shapes.

Install (Python >= 3.11). The full requirements are heavy, since they pull torch,
transformers and torchvision:
    python3.11 -m venv venv && . venv/bin/activate
    pip install torch                 # any version in 2.9.0 ..= 2.14.1
    pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0
    pip install "openai>=2" pydantic pydantic-settings httpx safetensors \
        "datasets>=4,<=5.1.0" "transformers>=5,<=5.19.0" loguru psutil rich \
        typer click aiohttp huggingface-hub protobuf "tqdm<=4.70.1"
(`pip install speculators==0.9.0` with its dependencies also works.)

Run:
    strata serve --model M --hidden-states-dir /tmp/hs --port 8000 \
        --served-model-name my/llama --dtype bf16 &
    strata serve --model M --hidden-states-dir /tmp/hs8 --port 8001 \
        --served-model-name my/llama --dtype fp8 &            # for check 3
    python scripts/check_serve_with_speculators.py http://127.0.0.1:8000/v1 my/llama \
        --fp8-url http://127.0.0.1:8001/v1 --vocab-size 256 --max-len 200

Exit status 0 when every check passed, 1 otherwise. The last line is
"N passed, N failed".
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import traceback
import types
from pathlib import Path

RESULTS: list[tuple[str, bool, str]] = []


def record(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, ok, detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""), flush=True)
    return ok


def make_prompts(n: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, max_len]
    while len(lengths) < n:
        lengths.append(rng.randint(1, max_len))
    return [[rng.randrange(vocab) for _ in range(t)] for t in lengths[:n]]


def setup_client(url: str, model: str, transfer):
    """Run the trainer's own ArrowDataset._setup_client on a stand-in `self`."""
    from speculators.train.data import ArrowDataset

    me = types.SimpleNamespace(vllm_endpoint=url, model=model, transfer=transfer, client=None)
    ArrowDataset._setup_client(me)  # noqa: SLF001  (the real method, unbound)
    return me.client, me.model


def check_client(url: str, model: str) -> object | None:
    from hs_connectors import FileTransfer

    try:
        client, found = setup_client(url, model, FileTransfer(Path("/nonexistent")))
        models = client.models.list()
        ids = [m.id for m in models.data]
        record("1 client setup (_setup_client, models.list)", found == model,
               f"data[0].id={found!r}, all ids={ids}")
    except Exception as e:  # noqa: BLE001
        record("1 client setup (_setup_client, models.list)", False, f"{type(e).__name__}: {e}")
        return None
    try:
        setup_client(url, model + "-wrong", FileTransfer(Path("/nonexistent")))
        record("1 wrong model name is rejected by the trainer", False, "no error raised")
    except ValueError as e:
        record("1 wrong model name is rejected by the trainer", "doesn't match" in str(e), str(e))
    # The server should also refuse an unknown model in a request, like vLLM does.
    try:
        client.completions.create(model=model + "-wrong", prompt=[1, 2], max_tokens=1,
                                  extra_body={"return_token_ids": True})
        record("1 completions with an unknown model -> 404", False, "request succeeded")
    except Exception as e:  # noqa: BLE001
        status = getattr(e, "status_code", None)
        record("1 completions with an unknown model -> 404", status == 404,
               f"{type(e).__name__} status={status}: {e}")
    return client


def round_trip(client, model, transfer, prompts, label):
    """generate_hidden_states -> get_generated -> check_hidden_states -> delete.

    Returns {prompt index: loaded sample}, the served paths, and the directories."""
    import torch
    from hs_connectors.fp8_utils import SCALES_KEY
    from speculators.data_generation.offline import check_hidden_states
    from speculators.data_generation.vllm_client import generate_hidden_states

    loaded: dict[int, dict] = {}
    paths: list[Path] = []
    for i, ids in enumerate(prompts):
        name = f"{label} prompt {i} (T={len(ids)})"
        handle = None
        try:
            handle, params = generate_hidden_states(client, model, {"input_ids": ids},
                                                    timeout=120, max_retries=0)
            paths.append(Path(handle))
            raw_keys = sorted(params)
            sample = transfer.get_generated(params)
            if sample is None:
                raise ValueError(f"Failed to load hidden states for handle {handle}")
            if SCALES_KEY in sample:
                raise ValueError(f"{SCALES_KEY} still present after {type(transfer).__name__}: "
                                 "an fp8 file read by the file backend (raw e4m3 codes)")
            check_hidden_states(sample, ids)
            hs, tok = sample["hidden_states"], sample["token_ids"]
            transfer.delete(handle)
            gone = not Path(handle).exists() and not Path(handle + ".lock").exists()
            loaded[i] = sample
            record(name, gone,
                   f"kv_transfer_params keys={raw_keys}, hidden_states {tuple(hs.shape)} {hs.dtype}, "
                   f"token_ids {tuple(tok.shape)} {tok.dtype}, finite={bool(torch.isfinite(hs.float()).all())}"
                   + ("" if gone else ", file or .lock still present after delete"))
        except Exception as e:  # noqa: BLE001
            record(name, False, f"{type(e).__name__}: {e}")
            if handle is not None and Path(handle).exists():
                Path(handle).unlink()
    return loaded, paths


def check_dir_empty(paths: list[Path], label: str, allow_other: bool) -> None:
    for d in sorted({p.parent for p in paths}):
        # The server's lock and record of its runs (.strata-serve.lock) stays while it serves.
        left = sorted(x.name for x in d.iterdir() if x.name != ".strata-serve.lock") if d.exists() else []
        record(f"{label} directory empty after delete ({d})", not left or allow_other,
               f"left: {left}" if left else "empty")


def raw_file_layout(client, model, ids) -> str:
    """What the fp8 server writes on disk, read with safetensors directly."""
    from safetensors.torch import load_file
    from speculators.data_generation.vllm_client import generate_hidden_states

    handle, _ = generate_hidden_states(client, model, {"input_ids": ids}, max_retries=0)
    try:
        raw = load_file(handle)
        return ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in sorted(raw.items()))
    finally:
        Path(handle).unlink()


def check_fp8(url8, model, prompts, ref, tol, allow_other):
    import torch
    from hs_connectors import FP8Transfer

    try:
        client8, _ = setup_client(url8, model, FP8Transfer(Path("/nonexistent")))
        record("3 fp8 server client setup", True)
    except Exception as e:  # noqa: BLE001
        record("3 fp8 server client setup", False, f"{type(e).__name__}: {e}")
        return
    try:
        print(f"    fp8 file on disk: {raw_file_layout(client8, model, prompts[0])}")
    except Exception as e:  # noqa: BLE001
        record("3 fp8 raw file readable", False, f"{type(e).__name__}: {e}")
    loaded, paths = round_trip(client8, model, FP8Transfer(Path("/nonexistent")), prompts, "3 fp8")
    worst_tok = worst_elem = worst_glob = 0.0
    for i, s in loaded.items():
        if i not in ref:
            continue
        a = s["hidden_states"].float()
        b = ref[i]["hidden_states"].float()
        if a.shape != b.shape:
            record(f"3 fp8 vs bf16 prompt {i}", False, f"shape {tuple(a.shape)} vs {tuple(b.shape)}")
            continue
        err = (a - b).abs()
        amax_tok = b.abs().amax(dim=tuple(range(1, b.dim())), keepdim=True).clamp(min=1e-30)
        worst_tok = max(worst_tok, float((err / amax_tok).max()))
        big = b.abs() >= 0.01 * amax_tok  # elementwise, ignoring values near zero
        if big.any():
            worst_elem = max(worst_elem, float((err[big] / b.abs()[big]).max()))
        worst_glob = max(worst_glob, float(err.norm() / b.norm().clamp(min=1e-30)))
        if not bool(torch.isfinite(a).all()):
            record(f"3 fp8 prompt {i} finite", False, "non-finite after dequantisation")
    record("3 fp8 dequantised vs bf16 server", bool(loaded) and worst_tok <= tol,
           f"max |fp8-bf16|/amax(token) = {worst_tok:.4g} (tol {tol}); "
           f"max elementwise rel err (|bf16| >= 1% of amax) = {worst_elem:.4g}; "
           f"max ||fp8-bf16||/||bf16|| per prompt = {worst_glob:.4g}")
    check_dir_empty(paths, "3 fp8", allow_other)


def check_dataset(url, model, prompts):
    import torch
    from datasets import Dataset
    from hs_connectors import FileTransfer
    from speculators.train.data import ArrowDataset, CollateFn

    with tempfile.TemporaryDirectory() as tmp:
        rows = prompts[:4]
        ds = Dataset.from_dict({
            "input_ids": [torch.tensor(r, dtype=torch.long) for r in rows],
            "loss_mask": [torch.ones(len(r), dtype=torch.long) for r in rows],
            "seq_len": [len(r) for r in rows],
        })
        ds.set_format(type="torch")
        ds.save_to_disk(f"{tmp}/data")
        hs_dir = Path(tmp) / "data" / "hidden_states"  # the trainer's default cache dir
        dataset = ArrowDataset(max_len=512, datapath=f"{tmp}/data", transfer=FileTransfer(hs_dir),
                               vllm_endpoint=url, on_missing="generate", model=model,
                               max_retries=0, generation_validation_retries=0)
        items = []
        for i in range(len(dataset)):
            item = dataset[i]
            if not isinstance(item, dict):
                record(f"4 ArrowDataset[{i}] (on_missing=generate)", False, repr(item))
                continue
            items.append(item)
            shapes = {k: (tuple(v.shape), str(v.dtype)) for k, v in item.items()}
            ok = (torch.equal(item["input_ids"], torch.tensor(rows[i]))
                  and item["verifier_last_hidden_states"].shape[0] == len(rows[i]))
            record(f"4 ArrowDataset[{i}] (on_missing=generate)", ok, f"{shapes}")
        if items:
            h = items[0]["verifier_last_hidden_states"].shape[-1]
            n_aux = items[0]["hidden_states"].shape[-1] // h
            batch = CollateFn(max_len=512, hidden_size=h, num_target_layers=n_aux)(items)
            shapes = {k: tuple(v.shape) for k, v in batch.items() if hasattr(v, "shape")}
            record("4 CollateFn", True, f"aux layers={n_aux}, hidden={h}, batch {shapes}")
        left = sorted(x.name for x in hs_dir.iterdir()) if hs_dir.exists() else []
        record("4 no hs_<i> cache files written into the trainer's hidden_states dir", not left,
               f"left: {left}" if left else "none")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base_url", help="e.g. http://127.0.0.1:8000/v1 (the trainer's --vllm-endpoint)")
    ap.add_argument("model", help="the served model name (the trainer's --verifier-name-or-path)")
    ap.add_argument("--fp8-url", help="a second server of the same model started with --dtype fp8")
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp8-tol", type=float, default=0.07)
    ap.add_argument("--allow-other-files", action="store_true",
                    help="do not fail when the served directory holds other files at the end")
    ap.add_argument("--skip-dataset", action="store_true", help="skip check 4")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import openai
    import torch
    from importlib.metadata import version

    print(f"speculators {version('speculators')}, hs-connectors {version('hs-connectors')}, "
          f"openai {openai.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}")
    prompts = make_prompts(args.prompts, args.max_len, args.vocab_size, args.seed)
    print(f"prompt lengths: {[len(p) for p in prompts]}")

    try:
        client = check_client(args.base_url, args.model)
        if client is not None:
            from hs_connectors import FileTransfer

            ref, paths = round_trip(client, args.model, FileTransfer(Path("/nonexistent")),
                                    prompts, "2 file")
            check_dir_empty(paths, "2 file", args.allow_other_files)
            if args.fp8_url:
                check_fp8(args.fp8_url, args.model, prompts, ref, args.fp8_tol, args.allow_other_files)
            if not args.skip_dataset:
                check_dataset(args.base_url, args.model, prompts)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        record("unexpected error", False, f"{type(e).__name__}: {e}")

    passed = sum(ok for _, ok, _ in RESULTS)
    failed = len(RESULTS) - passed
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
