"""What accelerate's test scripts import from `accelerate.test_utils`, written for the conformance run.

Small implementations of our own with the same behaviour: the regression data and model the scripts
train, the tensor and exception checks, and the `require_*` skip markers.
"""

from .testing import are_the_same_tensors, assert_exception, require_bnb, require_multi_device  # noqa: F401
from .training import RegressionDataset, RegressionModel  # noqa: F401
