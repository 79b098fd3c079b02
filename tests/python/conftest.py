import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import the harness as a plain module
