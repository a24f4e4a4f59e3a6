"""Stage 5, the acceptance record: built, written atomically, signed and verified.

- :mod:`core.record.build`: the record's tables from what the stages returned, the atomic write.
- :mod:`core.record.verdicts`: the one verdict engine: each stage's verdict from typed facts, which build, verify and
  command mode's records all call.
- :mod:`core.record.schema`: the record's keys and value types, per schema version.
- :mod:`core.record.signing`: ``ssh-keygen -Y sign`` / ``verify`` of a record file (nothing else of the package).
- :mod:`core.record.verify`: ``gpuaccept verify``: signature, schema, every verdict recomputed from the numbers
  (:func:`core.record.verify.record_problems`: the schema first, then the verdicts).
- :mod:`core.record.signoff`: the sign-off added, the record checked, then signed (``gpuaccept sign``).

Layers, top to bottom (an import contract in pyproject.toml): signoff, verify, build, schema and signing; a module
imports only those below it, so the package has no import cycle.
"""
