"""What runs in the child process (``python -m core.child.worker JOB.json``): the only package that imports torch at
module level.

- :mod:`core.child.worker`: the entry and the roles (probe, evaluate, train, interrupted, resumed).
- :mod:`core.child.recipe`: the recipe, top to bottom: build the model, wrap LoRA, the data, Trainer with the
  measuring callbacks (:mod:`core.child.callbacks`: the measuring trainer, the step reporter, the kill switch).
- :mod:`core.child.probe`: the probe's steps (Trainer, inference, FSDP2 on CPU ranks) and its ledger.
- :mod:`core.child.events`: the typed events, one frozen dataclass per kind, written here and parsed by the parent.
- :mod:`core.child.measure`: live tensors and the optimizer's states, counted from the tensors themselves.
- :mod:`core.child.evaluate`: token-weighted held-out perplexity.
- :mod:`core.child.events`, :mod:`core.child.rng`, :mod:`core.child.manifest`, :mod:`core.child.lifeline`: used on
  both sides (the typed events, the RNG digest, the checkpoint's sha256 manifest, a child that ends when its parent is
  gone), torch imported lazily (never, for the events).

The child never imports the parent-side stages (:mod:`core.stages`), the pipeline or the record: an import contract
(``make lint``) checks it.
"""
