"""Stage 1, the plan: what each device will hold, per component and per phase, before anything runs.

- :mod:`core.plan.memory`: the analytic plan per device and strategy (its types, its convention and
  :func:`core.plan.memory.plan_memory`, which puts the parts together), with, in layers below it: :mod:`core.plan.strategies` (each
  device's step by strategy), :mod:`core.plan.lines` (each component's line: weights, gradients, optimizer states,
  activations, temporaries, KV cache, overhead), :mod:`core.plan.quant` (bitsandbytes' 4-bit and 8-bit layouts,
  QLoRA's base), :mod:`core.plan.meta` (the meta model and its summary); :mod:`core.plan.devices`: the devices detected
  with their capacities.
- :mod:`core.plan.activations`: activations op by op for the Llama family; :mod:`core.plan.phases`: the phases of a
  step and the peak among them; :mod:`core.plan.shapes`: the fast path from a bare ``config.json``.
- :mod:`core.plan.fit`: does the plan fit each device (the one fit rule), and is a measured peak above it (an
  under-estimate); :mod:`core.plan.search`: the largest micro-batch or sequence length that fits.
- :mod:`core.plan.traced`: one step on fake tensors (FakeTensorMode + MemTracker) in a child process, beside the
  analytic plan.

Nothing here imports torch at module level: the plan of a bare ``config.json`` needs no weights and no torch.
"""
