"""Training functions run by tests/test_accelerator.py, on 1 process in-process or N via run_ranks."""

import os

import torch


def make_data(n=64, features=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = x @ torch.arange(1.0, features + 1).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def make_model(seed=1, dropout=0.0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(dropout), torch.nn.Linear(8, 1))


def reference_params(global_batch, steps_per_epoch_data=64, epochs=2):
    """Plain single-process training with the whole global batch per step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(make_data(steps_per_epoch_data), batch_size=global_batch)
    for _ in range(epochs):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def accumulated_params(per_rank_batch, accumulation, epochs=2):
    """The same training through Accelerator, with gradient accumulation, on however many ranks run it."""
    from notebook_accel import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=per_rank_batch)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    syncs = []
    for _ in range(epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                syncs.append(accelerator.sync_gradients)
                opt.step()
                opt.zero_grad()
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return params, syncs, accelerator.num_processes


def sync_pattern(batches=5, steps=2):
    from notebook_accel import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=steps)
    model = make_model()
    loader = torch.utils.data.DataLoader(make_data(batches * accelerator.num_processes), batch_size=1)
    model, loader = accelerator.prepare(model, loader)
    pattern = []
    for _batch in loader:
        with accelerator.accumulate(model):
            pattern.append(accelerator.sync_gradients)
    return pattern


def metrics_rows(n=99, batch=8):
    """gather_for_metrics over an evenly padded loader returns exactly the n real rows, in order."""
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    data = torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1))
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=batch))
    rows = []
    for (x,) in loader:
        rows.append(accelerator.gather_for_metrics(x))
    return torch.cat(rows).squeeze(1).tolist()


def train_with_checkpoint(folder, stop_after=None, resume=False, epochs=3, seed_offset=0, style="stateful"):
    """Shuffled loader + dropout; optionally save after `stop_after` steps, or resume and finish.

    `style` is how the resumed run finds its place in the epoch: "stateful" (prepared with
    use_stateful_dataloader=True, load_state restores the position), or accelerate's own resume code
    without it: "skip" (skip_first_batches with the step count worked out from len(loader), as in
    accelerate's examples) or "count" (iterate from the top and `continue` past the done batches).
    """
    from notebook_accel import Accelerator
    from notebook_accel.utils import DataLoaderConfiguration, set_seed

    set_seed(1234 + seed_offset)
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=style == "stateful")
    )
    model = make_model(seed=7 + seed_offset, dropout=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    gen = torch.Generator().manual_seed(99 + seed_offset)
    loader = torch.utils.data.DataLoader(make_data(48), batch_size=4, shuffle=True, generator=gen)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    start_epoch, done, resume_step = 0, 0, 0
    if resume:
        accelerator.load_state(folder)
        if style == "stateful":
            start_epoch = loader.state_dict()["epoch"]
        else:  # accelerate's examples: the step count is in the checkpoint's name, here a file
            with open(os.path.join(folder, "step.txt")) as f:
                step = int(f.read())
            start_epoch, resume_step = divmod(step, len(loader))
    losses = []
    for epoch in range(start_epoch, epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        batches = loader
        if style == "skip" and epoch == start_epoch and resume_step:
            batches = accelerator.skip_first_batches(loader, resume_step)
        for i, (x, y) in enumerate(batches):
            if style == "count" and epoch == start_epoch and i < resume_step:
                continue
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
            done += 1
            if stop_after is not None and done == stop_after:
                accelerator.save_state(folder)
                with open(os.path.join(folder, "step.txt"), "w") as f:
                    f.write(str(done))
                return None, losses
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return params, losses
