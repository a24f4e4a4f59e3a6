"""What runs in the child process (``python -m core.child.worker JOB.json``): the only package that imports torch at
module level.

- :mod:`core.child.worker`: the recipe, top to bottom: build the model, wrap LoRA, Trainer with the measuring callback,
  the kill points, the events.
- :mod:`core.child.measure`: live tensors and the optimizer's states, counted from the tensors themselves.
- :mod:`core.child.evaluate`: token-weighted held-out perplexity.
- :mod:`core.child.rng`, :mod:`core.child.manifest`, :mod:`core.child.lifeline`: used on both sides (the RNG digest,
  the checkpoint's sha256 manifest, a child that ends when its parent is gone), torch imported lazily.

The child never imports the parent-side stages (:mod:`core.stages`), the pipeline or the record: an import contract
(``make lint``) checks it.
"""
