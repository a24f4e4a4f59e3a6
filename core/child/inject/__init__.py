"""What gpuaccept's command mode (issue 21) puts on a user's training command's ``PYTHONPATH``: this folder's
``sitecustomize.py``, which adds gpuaccept's reporting callback (:mod:`core.child.inject.trainer_hook`) to every
``transformers.Trainer`` the user's script creates, with no change to the script."""
