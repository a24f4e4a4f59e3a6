"""Stage 1, the plan: what each device will hold, per component and per phase, before anything runs.

- :mod:`core.plan.memory`: the analytic plan per device and strategy (weights, gradients, optimizer states,
  activations, temporaries, overhead), devices detected with their capacities.
- :mod:`core.plan.activations`: activations op by op for the Llama family; :mod:`core.plan.phases`: the phases of a
  step and the peak among them; :mod:`core.plan.shapes`: the fast path from a bare ``config.json``.
- :mod:`core.plan.fit`: does the plan fit each device (the one fit rule), and is a measured peak above it (an
  under-estimate); :mod:`core.plan.search`: the largest micro-batch or sequence length that fits.
- :mod:`core.plan.traced`: one step on fake tensors (FakeTensorMode + MemTracker) in a child process, beside the
  analytic plan.

Nothing here imports torch at module level: the plan of a bare ``config.json`` needs no weights and no torch.
"""
