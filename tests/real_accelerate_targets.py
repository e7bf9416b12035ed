"""Functions launched on ranks that use Hugging Face's accelerate (and transformers) themselves, for
tests/test_real_accelerate.py. Each puts the given install folders first on the rank's sys.path before
importing them: the test process itself never imports them."""

from __future__ import annotations

import os


def _use(folders):
    import sys

    for folder in reversed(folders):
        sys.path.insert(0, folder)
    import accelerate

    if not accelerate.__file__.startswith(folders[0] + os.sep):
        raise AssertionError(f"accelerate came from {accelerate.__file__}, not from {folders[0]}")
    return accelerate


def _rank_seeded():
    # A different start on every rank: only a real process group (DDP's broadcast) makes them agree.
    import torch

    torch.manual_seed(int(os.environ["RANK"]))


def _weights(model) -> dict:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def accelerator_trains(folders):
    accelerate = _use(folders)
    import torch

    _rank_seeded()
    accelerator = accelerate.Accelerator()
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=data), torch.randn(16, 1, generator=data))
    loader = torch.utils.data.DataLoader(dataset, batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = 0
    for inputs, targets in loader:
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()
        batches += 1
    return {
        "file": accelerate.__file__,
        "use_cpu": os.environ.get("ACCELERATE_USE_CPU"),
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "type": str(accelerator.distributed_type),
        "batches": batches,
        "weights": _weights(accelerator.unwrap_model(model)),
    }


def partial_states(folders):
    """What accelerate's PartialState gives bare, and once an Accelerator has resolved the state."""
    accelerate = _use(folders)

    def seen(state):
        return state.num_processes, str(state.distributed_type), state.process_index

    bare = seen(accelerate.PartialState())
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.Accelerator()
    return {"bare": bare, "after_accelerator": seen(accelerate.PartialState())}


def trainer_trains(folders, output_dir):
    _use(folders)
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    _rank_seeded()
    config = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=2,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    data = torch.Generator().manual_seed(0)
    dataset = [
        {"input_ids": torch.randint(0, 50, (8,), generator=data), "labels": torch.tensor(i % 2)} for i in range(16)
    ]
    # use_cpu left at its default: the launcher's ACCELERATE_USE_CPU is what makes this one job.
    args = TrainingArguments(
        output_dir=output_dir, max_steps=3, per_device_train_batch_size=2, report_to=[], save_strategy="no",
        disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    return {
        "world_size": args.world_size,
        "num_processes": trainer.accelerator.num_processes,
        "weights": _weights(trainer.model),
    }


def own_state():
    """notebook_accel's own state in a rank, and the variable the rank got."""
    from notebook_accel.state import AcceleratorState, PartialState

    partial = PartialState()
    state = AcceleratorState()
    return (
        os.environ.get("ACCELERATE_USE_CPU"),
        str(partial.distributed_type),
        partial.num_processes,
        partial.process_index,
        partial.backend,
        str(state.device),
    )
