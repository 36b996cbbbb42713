"""Shared by the checkpoint fault tests: a tiny model, a saved checkpoint, and ways to damage it."""
import errno
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from parallel3d.training import checkpoint_metadata, checkpointing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK = "mp_rank_00_000"


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))


def tiny_model(seed=0):
    torch.manual_seed(seed)
    model = [Tiny()]
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    model[0].fc(torch.ones(2, 4)).sum().backward()
    opt.step()  # momentum buffers: optimizer.pt holds real state
    return model, opt


def weights_of(model):
    return {k: v.clone() for k, v in model[0].state_dict().items()}


def same_weights(model, weights):
    return all(torch.equal(v, weights[k]) for k, v in model[0].state_dict().items())


def save_tiny(tmp_path):
    """(save dir, model, optimizer, weights) with iteration 2 saved."""
    model, opt = tiny_model()
    save_dir = str(tmp_path / "ckpt")
    checkpointing.save_checkpoint(save_dir, 2, model, opt, extra={"consumed_train_samples": 32})
    return save_dir, model, opt, weights_of(model)


def ckpt_file(save_dir, rel, iteration=2):
    return os.path.join(checkpointing.iteration_dir(save_dir, iteration), rel)


def flip_byte(path, offset=-20):
    with open(path, "r+b") as f:
        size = os.path.getsize(path)
        f.seek(offset % size)
        b = f.read(1)
        f.seek(offset % size)
        f.write(bytes([b[0] ^ 0xFF]))


def edit_metadata(save_dir, change, iteration=2, rerecord=True):
    """Edit metadata.json; ``rerecord``: as an attacker who also rewrites its checksum file."""
    ckpt_dir = checkpointing.iteration_dir(save_dir, iteration)
    meta = checkpointing.read_metadata(ckpt_dir)
    change(meta)
    if rerecord:
        checkpoint_metadata.write_metadata(ckpt_dir, meta)
    else:
        json.dump(meta, open(os.path.join(ckpt_dir, checkpointing.METADATA_FILE), "w"))


def drop_checksums(save_dir, iteration=2, old_headers=True):
    """What a checkpoint saved before checksums were kept looks like: format version 1, no file list, no
    metadata.json.sha256; ``old_headers``: its model files' headers say version 1 too (else: a downgrade)."""
    edit_metadata(save_dir, lambda meta: (meta.pop("files"), meta.update(format_version=1)), iteration)
    os.remove(ckpt_file(save_dir, checkpoint_metadata.METADATA_CHECKSUM_FILE, iteration))
    ckpt_dir = checkpointing.iteration_dir(save_dir, iteration)
    for name in sorted(os.listdir(ckpt_dir)) if old_headers else []:
        path = os.path.join(ckpt_dir, name, "model.safetensors")
        if os.path.isfile(path):
            with safe_open(path, framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
                header = dict(f.metadata(), format_version="1")
            save_file(tensors, path, metadata=header)


def load_fresh(save_dir, model=None, opt=None, **kw):
    if model is None:
        model, opt = tiny_model(seed=1)
    return checkpointing.load_checkpoint(save_dir, model, opt, **kw)


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
