"""Calls `strata serve` exactly as the speculators trainer's client does
(speculators 0.9.0: data_generation/vllm_client.py, train/data.py,
hs_connectors/transfer.py), then does what the trainer does with the reply.

    python serve_client.py BASE_URL MODEL PROMPTS.json

Uses the `openai` package (>= 2, as speculators 0.9 requires), `safetensors`
and `numpy` (the trainer reads with safetensors.torch; numpy reads the same
file without torch, so the server runs with --dtype f32 here).
"""

import fcntl
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import openai
from safetensors.numpy import load_file


def wait_for_lock(lock_path, timeout=10.0, poll_interval=0.1):
    # hs_connectors.transfer.wait_for_lock: open O_RDWR, flock LOCK_EX|LOCK_NB, then remove.
    fd = os.open(lock_path, os.O_RDWR)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Timed out waiting for lock: {lock_path}")
                time.sleep(poll_interval)
    finally:
        os.close(fd)
    os.remove(lock_path)


def main():
    base, model, prompts_path = sys.argv[1:4]
    prompts = json.loads(Path(prompts_path).read_text())
    # train/data.py: _setup_client
    client = openai.OpenAI(base_url=base, api_key="EMPTY", max_retries=0)
    model_id = client.models.list().data[0].id
    assert model_id == model, f"served model {model_id!r} is not {model!r}"
    shapes = set()
    for ids in prompts:
        # vllm_client.py: the completions call, word for word.
        res = client.completions.create(
            model=model, prompt=ids, max_tokens=1, extra_body={"return_token_ids": True}, timeout=120
        )
        assert isinstance(res, openai.types.Completion), type(res)
        # vllm_client.py: extract_output
        prompt_token_ids = getattr(res.choices[0], "prompt_token_ids", None)
        assert prompt_token_ids is not None, "Response missing prompt_token_ids"
        assert prompt_token_ids == ids, "Prompt token IDs mismatch"
        kv_transfer_params = getattr(res, "kv_transfer_params", None)
        assert kv_transfer_params is not None, "Response missing kv_transfer_params"
        handle = kv_transfer_params.get("hidden_states_path") or kv_transfer_params.get("handle")
        assert handle is not None
        path = Path(handle)
        try:
            # hs_connectors/transfer.py: _load_hs_file
            lock = str(path) + ".lock"
            if Path(lock).exists():
                wait_for_lock(lock)
            assert path.exists(), f"{path} does not exist after the reply"
            data = load_file(path)
            # speculators/data_generation/offline.py: check_hidden_states
            assert {"token_ids", "hidden_states"} <= set(data), sorted(data)
            assert data["token_ids"].dtype == np.int64, data["token_ids"].dtype
            assert data["token_ids"].tolist() == ids
            hs = data["hidden_states"]
            assert hs.ndim == 3 and hs.shape[0] == len(ids), hs.shape
            assert np.isfinite(hs).all(), "Hidden states contain non-finite values"
            assert data["loss_mask"].tolist() == [1] * len(ids)
            shapes.add(hs.shape[1:])
        finally:
            # train/data.py: the file is deleted on success and on failure alike.
            path.unlink(missing_ok=True)
    assert len(shapes) == 1, shapes
    print(f"ok {len(prompts)} prompts, [T, L, H] with (L, H) = {shapes.pop()}, openai {openai.__version__}")


if __name__ == "__main__":
    main()
