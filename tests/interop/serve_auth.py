"""The speculators trainer's own client against `strata serve`, with and
without --api-key (speculators 0.9.0).

    python serve_auth.py BASE_URL MODEL 401|files

The client code is speculators' own: `speculators/data_generation/vllm_client.py`
from the installed wheel, loaded by path (the package's __init__ imports torch,
which CI does not install; that module needs only `openai`). The client is set
up as the trainer sets it up (train/data.py, ArrowDataset._setup_client:
`openai.OpenAI(base_url=..., api_key="EMPTY", max_retries=0)`, then
`models.list()`), since train/data.py imports torch too.

401:   every call is refused at once with openai.AuthenticationError (no retry
       of the openai client's own; the trainer's first call, models.list, fails
       within a second), and the message says a key is required.
files: the trainer's calls work; each file loads and holds the prompt's ids.
"""

import importlib.util
import os
import sys
import time
from pathlib import Path

import openai
from safetensors.numpy import load_file


def speculators_client():
    spec = importlib.util.find_spec("speculators")
    assert spec is not None and spec.submodule_search_locations, "speculators is not installed"
    path = Path(list(spec.submodule_search_locations)[0]) / "data_generation" / "vllm_client.py"
    mod_spec = importlib.util.spec_from_file_location("speculators_vllm_client", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod, path


def main():
    base, model, expect = sys.argv[1:4]
    vllm_client, path = speculators_client()
    # train/data.py: _setup_client, word for word.
    client = openai.OpenAI(base_url=base, api_key="EMPTY", max_retries=0)
    if expect == "401":
        t = time.monotonic()
        try:
            client.models.list()
        except openai.AuthenticationError as e:
            took = time.monotonic() - t
            assert took < 1.0, f"the 401 took {took:.2f} s"
            assert "requires an API key" in str(e), str(e)
        else:
            raise AssertionError("models.list() passed without the key")
        # The trainer's request itself, without the trainer's retry loop (max_retries=0): refused at once too.
        t = time.monotonic()
        try:
            vllm_client.generate_hidden_states(client, model, {"input_ids": [1, 2, 3]}, timeout=120, max_retries=0)
        except openai.AuthenticationError as e:
            took = time.monotonic() - t
            assert took < 1.0, f"the 401 took {took:.2f} s"
        else:
            raise AssertionError("generate_hidden_states passed without the key")
        print(f"ok 401 at once for the trainer's client ({path.name} of speculators), openai {openai.__version__}")
        return
    model_id = client.models.list().data[0].id
    assert model_id == model, (model_id, model)
    for ids in ([1, 2, 3], list(range(5, 45))):
        handle, params = vllm_client.generate_hidden_states(client, model, {"input_ids": ids}, timeout=120)
        data = load_file(handle)
        assert data["token_ids"].tolist() == ids
        assert data["hidden_states"].shape[0] == len(ids)
        os.remove(handle)
    print(f"ok files for the trainer's client ({path.name} of speculators) without a key")


if __name__ == "__main__":
    main()
