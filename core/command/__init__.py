"""Command mode: accept the user's own training command, as they run it (their script, their checkpoints, their resume
flag), instead of gpuaccept's own Trainer recipe.

The stages, in order (:mod:`core.command.pipeline`):

1. **probe**: the command runs once, uninterrupted, in its own session (:mod:`core.command.process`), measured from
   inside when it is Trainer-based (``core/child/inject``: every Trainer the unchanged script creates reports its
   arguments, model, steps, batches, checkpoints and peak memory per rank) and always from outside (the RSS of its
   whole process tree per rank, sampled; on GPUs NVML's per-process memory). This run is also the reference of the
   resume check.
2. **plan**: made from what ran (the model config, micro-batch, sequence length, precision, optimizer, LoRA settings
   and world size the Trainer reported; :mod:`core.command.plan`) and compared per device with the measured peak; a
   script that reported no Trainer gets no plan (said so).
3. **evaluation**: held-out perplexity of the final checkpoint (a Hugging Face model or adapter folder) against its
   base, on gpuaccept's held-out split, or the user's own evaluation command printing a JSON metric
   (:mod:`core.command.evaluate`).
4. **resume**: the command again, SIGKILLed (whole process tree, every rank) after checkpoint c and before the next,
   then the resume command from checkpoint c, compared step by step and at the last checkpoint with the reference
   (:mod:`core.command.resume`).
5. **record**: ``record.toml`` of kind ``command`` (:mod:`core.command.record`), checked by ``gpuaccept verify``.
"""
