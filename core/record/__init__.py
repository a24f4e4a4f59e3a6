"""Stage 5, the acceptance record: built, written atomically, signed and verified.

- :mod:`core.record.build`: the record's tables from what the stages returned, each verdict, the atomic write.
- :mod:`core.record.schema`: the record's keys and value types, per schema version.
- :mod:`core.record.signing`: ``ssh-keygen -Y sign`` / ``verify`` of a record file.
- :mod:`core.record.verify`: ``gpuaccept verify``: signature, schema, every verdict recomputed from the numbers.
"""
