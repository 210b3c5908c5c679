#!/usr/bin/env python3
"""Write the RoPE inverse frequencies transformers computes for Llama-4-Scout
(by hand, not in CI), the table tests/hub_configs.rs checks Strata against:

    venv/bin/python scripts/make_scout_inv_freq.py

Reads tests/fixtures/configs/llama-4-scout-17b-16e.json, builds its text
config as `from_pretrained` does (`Llama4TextConfig.from_dict`), takes
`Llama4TextRotaryEmbedding(config).inv_freq` (float32) and writes
tests/fixtures/configs/llama-4-scout-17b-16e.inv_freq.json: every frequency
(widened exactly to a double), the unscaled ones, which were divided by
`factor`, and the warnings transformers logged while building the config.

Scout's rope_scaling has high_freq_factor == low_freq_factor (1.0): transformers
warns and takes f / factor where the wavelength exceeds
original_max_position_embeddings / low_freq_factor, f elsewhere.
"""
import json
import logging
import math
from pathlib import Path

import torch
import transformers
from transformers import Llama4TextConfig
from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding
from transformers.utils import logging as hf_logging

ROOT = Path(__file__).resolve().parent.parent / "tests/fixtures/configs"
CONFIG = ROOT / "llama-4-scout-17b-16e.json"
OUT = ROOT / "llama-4-scout-17b-16e.inv_freq.json"


class Records(logging.Handler):
    """Keeps every transformers log message."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main():
    text = json.loads(CONFIG.read_text())["text_config"]
    # transformers 5 types `attn_temperature_tuning` as a bool; the printed config
    # this fixture copies writes 4. It does not touch RoPE.
    text["attn_temperature_tuning"] = bool(text["attn_temperature_tuning"])
    hf_logging.set_verbosity_warning()
    records = Records()
    hf_logging.get_logger().addHandler(records)
    config = Llama4TextConfig.from_dict(text)
    inv_freq = Llama4TextRotaryEmbedding(config).inv_freq
    params = config.rope_parameters
    dim = config.head_dim
    unscaled = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    threshold = params["original_max_position_embeddings"] / params["low_freq_factor"]
    wavelen = 2 * math.pi / unscaled
    divided = [i for i in range(dim // 2) if bool(wavelen[i] > threshold)]
    # The table must be what the rule says: no smoothed frequency in between.
    expect = torch.where(wavelen > threshold, unscaled / params["factor"], unscaled)
    assert torch.equal(expect, inv_freq), "transformers' frequencies are not the two-branch rule"
    out = {
        "source": "scripts/make_scout_inv_freq.py: Llama4TextRotaryEmbedding(Llama4TextConfig.from_dict("
        "text_config of llama-4-scout-17b-16e.json)).inv_freq",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "rope_parameters": params,
        "head_dim": dim,
        "inv_freq": [float(v) for v in inv_freq.tolist()],
        "unscaled_inv_freq": [float(v) for v in unscaled.tolist()],
        "divided_by_factor": divided,
        "warnings": records.messages,
    }
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}: {len(divided)} of {dim // 2} frequencies divided by {params['factor']}")


if __name__ == "__main__":
    main()
