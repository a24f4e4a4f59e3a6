"""What gpuaccept and its child processes agree on: neither side's code, both sides' terms.

- :mod:`core.protocol.events`: the child's events on the wire, one frozen dataclass per kind, the JSON lines the child
  writes (:class:`~core.protocol.events.EventWriter`) and the parent parses once
  (:func:`~core.protocol.events.read_events`).
- :mod:`core.protocol.manifest`: the checkpoint's sha256 manifest, written by the parent and verified on both sides.
- :mod:`core.protocol.rng`: the random generators' digest the child reports and the resume check compares.
- :mod:`core.protocol.lifeline`: a child that ends when gpuaccept is gone (the environment variable gpuaccept sets).
- :mod:`core.protocol.job`: the job a stage hands its child (:class:`~core.protocol.job.WorkerJob`, built once by
  :func:`~core.protocol.job.worker_job`; command mode's evaluation: :class:`~core.protocol.job.EvalJob`), as JSON.
- :mod:`core.protocol.faults`: the resume bugs planted on purpose (tests only): the environment variable that names one,
  which the child commits and the record reports.

Torch is imported lazily (never, for the events). Import contracts in pyproject.toml (``make lint``) keep this package
from both sides' code (the child's :mod:`core.child`, the parent's stages, pipeline, events and record) and keep the
parent side from :mod:`core.child`: the parent starts the child by module name and talks to it through these modules.
"""
