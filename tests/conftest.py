import os
import sys

# Children started by the tests import helpers from here.
sys.path.insert(0, os.path.dirname(__file__))
