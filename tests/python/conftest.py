import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import the harness as a plain module
# ... and the demo's model (examples/demo_model.py), which is an example, not part of the package
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
