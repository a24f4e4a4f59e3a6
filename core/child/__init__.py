"""What runs in the child process (``python -m core.child.worker JOB.json``): the only package that imports torch at
module level.

- :mod:`core.child.worker`: the entry and the roles (probe, evaluate, train, interrupted, resumed).
- :mod:`core.child.recipe`: the recipe, top to bottom: build the model, wrap LoRA, the data, Trainer with the
  measuring callbacks (:mod:`core.child.callbacks`: the measuring trainer, the step reporter, the kill switch).
- :mod:`core.child.probe`: the probe's steps (Trainer, inference, FSDP2 on CPU ranks) and its ledger.
- :mod:`core.child.measure`: live tensors and the optimizer's states, counted from the tensors themselves.
- :mod:`core.child.evaluate`: token-weighted held-out perplexity.
- :mod:`core.child.zygote`: the fork server the stage children are forked from; :mod:`core.child.checkpoint_eval`:
  command mode's evaluation of a checkpoint; ``inject/``: what is loaded into the user's own process (command mode).

What both sides use (the typed events and their writer, the RNG digest, the checkpoint's sha256 manifest, a child that
ends when its parent is gone, the planted faults) is in :mod:`core.protocol`, neither side's package. The child never
imports the parent-side stages (:mod:`core.stages`), the pipeline, the pipeline's events or the record, and the parent
never imports this package (it starts ``python -m core.child.worker`` by name; tests only, it reads the gradient
jitter's amplitude from ``inject/jitter.py``, which can import nothing of gpuaccept): import contracts (``make lint``)
check both.
"""
