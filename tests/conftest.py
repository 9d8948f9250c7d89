import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # dist_cases, importable by spawned ranks too
