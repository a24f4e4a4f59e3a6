"""The parent side of the stages that run a child process: start it, watch its events, compare with the plan.

- :mod:`core.stages.childproc`: start, watch and kill the child's process group (``torchrun`` for several ranks).
- :mod:`core.stages.probe`: stage 2, real steps measured per device against the plan.
- :mod:`core.stages.train`: stage 3, training with held-out perplexity before and after.
- :mod:`core.stages.resume`: stage 4, the kill-and-resume check: kill points, checkpoint forensics, the comparison.
- :mod:`core.stages.compare`: the resume comparison over typed step series, shared with command mode
  (core/command/resume.py).
"""
