"""Runs `speculators train` on a machine without a GPU, unchanged but for
where its tensors go: the trainer (speculators 0.9) moves its model and each
batch to `local_rank` (device 0, which is `cuda:0`) and autocasts for
"cuda" when it finds no accelerator. This wrapper, outside the package,
sends every such move to the CPU and lets autocast run on the CPU. Nothing
else of the trainer changes: its data loading, vocabulary mappings, model
and loss are its own.

    python scripts/speculators_train_cpu.py --verifier-name-or-path MODEL \\
        --data-path OUT --draft-vocab-size N --target-layer-ids A B C \\
        --draft-attn-impl sdpa --loss-implementation eager ...

Flex attention has no CPU backward and the fused loss is a Triton kernel:
pass `--draft-attn-impl sdpa --loss-implementation eager`.
"""

import sys

import torch


def _cpu(d):
    """Device 0 or any CUDA device becomes the CPU; anything else is kept."""
    if isinstance(d, bool):
        return d
    if isinstance(d, int) or (isinstance(d, (str, torch.device)) and str(d).startswith("cuda")):
        return torch.device("cpu")
    return d


def _redirect(to):
    def wrapped(self, *args, **kwargs):
        args = tuple(_cpu(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return to(self, *args, **kwargs)

    return wrapped


torch.nn.Module.to = _redirect(torch.nn.Module.to)
torch.Tensor.to = _redirect(torch.Tensor.to)


class _CpuAutocast(torch.autocast):
    """The trainer autocasts for its accelerator's type, "cuda" when it finds none."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


torch.autocast = _CpuAutocast
# Its step timer waits for the accelerator; the CPU has nothing to wait for.
if not torch.accelerator.is_available():
    torch.accelerator.synchronize = lambda *args, **kwargs: None

from speculators.train.cli import main  # noqa: E402
from speculators.train.config import TrainConfig  # noqa: E402

if __name__ == "__main__":
    main(TrainConfig.resolve(sys.argv[1:]))
