import os
import sys

# tests import their independent references (tests/reference.py) by module name
sys.path.insert(0, os.path.dirname(__file__))
