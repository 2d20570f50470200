"""Checkpoints of model, optimizer, step and data position (torch.distributed.checkpoint)."""

import os
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save(model, optimizer, step, next_row, directory):
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "progress": {"step": step, "next_row": next_row}}
    dcp.save(state, checkpoint_id=os.path.join(directory, f"step-{step:06d}"))


def latest_checkpoint(directory):
    found = sorted(Path(directory).glob("step-*")) if directory and os.path.isdir(directory) else []
    return str(found[-1]) if found else None


def load(model, optimizer, path, rows_per_step):
    """Restore model and optimizer in place; returns the step the checkpoint was taken after. Its
    data position must be where this run's step would read next (same --dp and --batch)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "progress": {"step": 0, "next_row": 0}}
    dcp.load(state, checkpoint_id=path)
    step, next_row = state["progress"]["step"], state["progress"]["next_row"]
    if next_row != step * rows_per_step:
        raise ValueError(
            f"{path} stopped at data row {next_row} after step {step}; this run reads {rows_per_step} rows a "
            "step (--dp x --batch): resume with the --dp and --batch it was saved with"
        )
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step
