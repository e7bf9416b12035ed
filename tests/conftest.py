import os
import sys

# Children started by the tests import helpers from here.
sys.path.insert(0, os.path.dirname(__file__))

# No test may read a developer's own launch config (~/.cache/notebook_accel): point at a missing file.
# Tests that need a config set NOTEBOOK_ACCEL_CONFIG_FILE themselves.
os.environ["NOTEBOOK_ACCEL_CONFIG_FILE"] = os.path.join(os.path.dirname(__file__), "no-such-config.yaml")
