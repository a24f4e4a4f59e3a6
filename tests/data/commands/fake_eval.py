"""An evaluation command for the tests of command mode: prints a JSON line with a metric of the checkpoint (or base
folder) given, as a user's own evaluation script would. For a fake_train.py checkpoint the metric falls as training
went on; for any other folder (the base) it is the untrained value."""

import json
import sys
from pathlib import Path

state = Path(sys.argv[1]) / "state.json"
total = json.loads(state.read_text())["sum"] if state.is_file() else 0.0
print("evaluating", sys.argv[1], flush=True)
result = {"metric": "fake loss", "value": 10.0 / (1.0 + total), "higher_is_better": False,
          "definition": "10 / (1 + the running sum of the checkpoint)"}
if "--no-direction" in sys.argv:  # a metric that does not say which way is better
    del result["higher_is_better"]
print(json.dumps(result))
